"""Text models from the command line: the vocabulary read from a Hugging Face ``config.json`` (or given with
``--vocab``), a decoder's key/value cache switched off for tracing, ``--scalings`` on every command that
traces, and the advice a float input to an embedding gets."""

from __future__ import annotations

import json

import pytest
import torch

import symlib
from symlib import cli

transformers = pytest.importorskip("transformers")


def _gpt2(seed: int):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2, n_positions=24,
                                  bos_token_id=0, eos_token_id=0)
    assert cfg.use_cache  # the default of a decoder: export would meet its DynamicCache
    return transformers.GPT2LMHeadModel(cfg)


@pytest.fixture(scope="module")
def gpt2_sets(tmp_path_factory):
    """Two sets of two GPT-2 folders each (``save_pretrained``: weights and ``config.json``)."""
    root = tmp_path_factory.mktemp("gpt2")
    for seed in range(4):
        _gpt2(seed).save_pretrained(root / ("a" if seed < 2 else "b") / f"seed{seed}")
    return root


def _run(argv, capsys) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_count_reads_the_vocabulary_from_config_json(gpt2_sets, capsys):
    folder = gpt2_sets / "a" / "seed0"
    want = symlib.count(symlib.spec_of(_gpt2(0).double(), (8,), vocab=40)).to_string(index=False)
    rc, out, err = _run(["count", folder], capsys)  # no --input-shape, no --vocab
    assert rc == 0, err
    assert want in out and "input shape (8,)" in out
    rc, out, err = _run(["count", folder, "--input-shape", "5", "--vocab", "30"], capsys)
    assert rc == 0 and "input shape (5,)" in out, err
    rc, out, err = _run(["count", folder, "--vocab", "41"], capsys)  # more ids than the embedding's rows
    assert rc == 2 and "vocab=41 is larger than the 40 rows" in err


def test_scalings_on_the_command_line(gpt2_sets, capsys):
    a, b = gpt2_sets / "a", gpt2_sets / "b"
    common = ["--permutations", "0", "--bootstrap", "0", "--json", "-"]
    rc, out, err = _run(["compare", a, b, *common], capsys)  # GELU: no scaling symmetry
    assert rc == 2 and "--scalings none or --scalings partial" in err
    raw = None
    for how in ("none", "partial"):
        rc, out, err = _run(["compare", a, b, *common, "--scalings", how], capsys)
        assert rc == 0, err
        got = symlib.compare(a, b, ("raw", "ns"), n_permutations=0, n_bootstrap=0, scalings=how)
        rows = {(r["symmetries"], r["layer"]): r["mmd"] for r in got.rows()}
        printed = {(r["symmetries"], r["layer"]): r["mmd"] for r in json.loads(out)["rows"]}
        assert printed.keys() == rows.keys()
        assert all(printed[k] == pytest.approx(rows[k], rel=1e-12, abs=1e-12) for k in rows)
        this_raw = {k: v for k, v in rows.items() if k[0] == "raw"}
        assert raw is None or this_raw == raw  # the raw rows do not depend on the symmetries traced
        raw = this_raw
    rc, out, err = _run(["count", a / "seed0", "--scalings", "none"], capsys)
    assert rc == 0 and "total" in out, err
    rc, out, err = _run(["canonicalize", a, "--to", gpt2_sets / "canon", "--scalings", "none"], capsys)
    assert rc == 0 and "canonical forms of 2 networks" in out, err


def test_a_float_input_to_an_embedding_gets_the_right_advice():
    model = transformers.BertModel(transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=24))
    with pytest.raises(symlib.SymmetryError, match=r"reads token ids .* pass vocab=N \(--vocab N"):
        symlib.spec_of(model, (8,))
    spec = symlib.spec_of(model, (8,), vocab=40)
    assert spec.vocab == 40 and spec.perms


def test_a_decoder_with_a_cache_is_traced_and_keeps_its_setting():
    model = _gpt2(0)
    spec = symlib.spec_of(model, (8,), vocab=40)
    assert spec.perms and model.config.use_cache  # switched off while tracing only


def test_merge_and_barrier_of_text_models(gpt2_sets, tmp_path, capsys):
    """``symlib merge --how activations`` matches two GPT-2 folders on random token ids (the embedded digits
    are images) and writes what ``symlib.merge`` returns on those tokens; ``symlib barrier``, which measures
    on the embedded digits, refuses a text model and says how to measure one in Python."""
    from symlib.cli.merge import matching_batch

    a, b = gpt2_sets / "a" / "seed0", gpt2_sets / "a" / "seed1"
    rc, out, err = _run(["merge", a, b, "--to", tmp_path / "m", "--how", "activations"], capsys)
    assert rc == 0, err
    got, _ = symlib.load(tmp_path / "m")
    model = _gpt2(0).eval()
    spec = symlib.spec_of(model, (8,), vocab=40, scalings="partial")
    sa, sb = (transformers.GPT2LMHeadModel.from_pretrained(p).state_dict() for p in (a, b))
    want = symlib.merge(sa, sb, spec, how="activations", batch=matching_batch(spec), model=model)
    assert all(torch.equal(got[k][0], want[k]) for k in want)
    rc, out, err = _run(["barrier", a, b], capsys)
    assert rc == 2 and "reads token ids" in err
    assert "symlib.barrier(a, b, model, data=(tokens, targets))" in err
