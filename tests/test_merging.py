"""Merging two networks (``symlib.merge``) and the barrier on the path between them (``symlib.barrier``),
in Python and on the command line.

The networks are a small MLP and a small CNN with BatchNorm (tests/ckpt_nets.py), trained for a few SGD
steps on the embedded MNIST digits from several seeds. What is checked:

* ``how="none"`` is the plain average;
* a network merged with a permuted copy of itself (the same function, other weights) comes back exactly
  after weight or activation matching, and not after the plain average (the negative control);
* the barrier of a network with itself is 0, its ends are the two networks' own loss and accuracy
  whatever the alignment (matching never changes ``b``'s function), and weight matching lowers the
  barrier of independently trained MLPs;
* ``symlib merge`` writes what ``symlib.merge`` returns, never over an existing file, and ``symlib barrier
  --json`` prints the numbers of ``symlib.barrier``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from ckpt_nets import DigitCNN, DigitMLP
from torch import nn

import symlib
from symlib import cli, data
from symlib.symmetry import ops

NETS = str(Path(__file__).resolve().parent / "ckpt_nets.py")
SHAPE = (1, 28, 28)
ARCHS = {"mlp": DigitMLP, "cnn": DigitCNN}


@pytest.fixture(scope="module")
def digits():
    return data.load("mnist", "train")


def _train(arch: str, seed: int, digits, steps: int = 150) -> dict[str, torch.Tensor]:
    """A state dict of ``arch`` after ``steps`` SGD steps (batches of 64) from ``seed``."""
    torch.manual_seed(seed)
    net = ARCHS[arch]()
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for _ in range(steps):
        i = torch.randint(0, len(digits.x), (64,), generator=g)
        opt.zero_grad()
        F.cross_entropy(net(digits.x[i]), digits.y[i]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


@pytest.fixture(scope="module")
def trained(digits):
    """``{arch: (model, spec, [state dicts of seeds 0 and 1])}``."""
    out = {}
    for arch, cls in ARCHS.items():
        model = cls()
        out[arch] = (model, symlib.spec_of(model, SHAPE), [_train(arch, s, digits) for s in (0, 1)])
    return out


def _permuted(theta, spec, seed):
    g = ops.random_element(spec, "perm", generator=torch.Generator().manual_seed(seed))
    return ops.permute(theta, spec, g.perms)


def _maxdiff(p, q) -> float:
    return max(float((p[k].double() - q[k].double()).abs().max()) for k in p)


@pytest.mark.parametrize("arch", ARCHS)
def test_none_is_the_plain_average(arch, trained):
    model, spec, (a, b) = trained[arch]
    merged = symlib.merge(a, b, spec, how="none")
    assert set(merged) == set(a)
    for k in a:
        want = (a[k] + b[k]) / 2 if a[k].is_floating_point() else a[k]
        torch.testing.assert_close(merged[k], want, rtol=0, atol=1e-6)
    quarter = symlib.merge(a, b, spec, how="none", t=0.25)
    torch.testing.assert_close(quarter["head.weight" if arch == "cnn" else "5.weight"],
                               0.75 * a["head.weight" if arch == "cnn" else "5.weight"]
                               + 0.25 * b["head.weight" if arch == "cnn" else "5.weight"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("how", ["weights", "activations"])
def test_a_permuted_copy_merges_back_to_the_original(arch, how, trained, digits):
    model, spec, (a, _) = trained[arch]
    moved = _permuted(a, spec, seed=3)
    x = digits.x[:500]
    with torch.no_grad():  # the copy computes the same function with other weights
        fa = torch.func.functional_call(model.eval(), a, (x,))
        fm = torch.func.functional_call(model, moved, (x,))
    torch.testing.assert_close(fm, fa, rtol=1e-4, atol=1e-4)
    assert _maxdiff(moved, a) > 1e-2
    before = {k: v.clone() for k, v in moved.items()}
    merged = symlib.merge(a, moved, spec, how=how, batch=x, model=model)
    assert _maxdiff(merged, a) < 1e-6
    assert _maxdiff(moved, before) == 0  # inputs are never mutated
    assert _maxdiff(symlib.merge(a, moved, spec, how="none"), a) > 1e-2  # the negative control


def test_bad_inputs_are_refused(trained, digits):
    model, spec, (a, b) = trained["mlp"]
    with pytest.raises(ValueError, match="unknown how"):
        symlib.merge(a, b, spec, how="sideways")
    with pytest.raises(ValueError, match="needs a batch of inputs"):
        symlib.merge(a, b, spec, how="activations")
    wider = DigitMLP(width=16).state_dict()
    with pytest.raises(symlib.SymmetryError, match="another architecture"):
        symlib.merge(a, wider, spec)
    with pytest.raises(symlib.SymmetryError, match="stack of networks"):
        symlib.merge(a, symlib.params.stack([b, b]), spec)

    class Custom(nn.Module):  # a hidden layer written through F.linear: no module output to record
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 784) / 28)
            self.head = nn.Linear(8, 10)

        def forward(self, x):
            return self.head(torch.relu(F.linear(x.flatten(1), self.w)))

    net = Custom()
    cspec = symlib.spec_of(net, SHAPE)
    theta = net.state_dict()
    with pytest.raises(symlib.SymmetryError, match="no Linear.*how='weights'"):
        symlib.merge(theta, theta, cspec, how="activations", batch=digits.x[:8], model=net)


class Grouped(nn.Module):
    """A grouped convolution between two plain ones: its hidden labels move in blocks (the groups)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3)
        self.conv2 = nn.Conv2d(8, 8, 3, groups=2)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(torch.relu(self.conv2(torch.relu(self.conv1(x)))).mean((2, 3)))


def _transformer(name: str):
    """``(model, spec, batch)`` of a float64 attention model with random weights: the chapter's TinyViT
    (``nn.MultiheadAttention``), and Hugging Face ViT (separate query, key, value), GPT-2 (fused ``Conv1D``
    projections, tied embeddings), Llama (rotary heads in two key-value groups) and T5 (a position-bias
    table of one column per head, tied with the heads of every layer) from their configs."""
    torch.manual_seed(0)
    if name == "grouped":
        model = Grouped().double().eval()
        return model, symlib.spec_of(model, SHAPE), torch.randn(16, *SHAPE, dtype=torch.float64)
    if name == "tinyvit":
        from symlib.paper.transformers import TinyViT

        model = TinyViT().double().eval()
        return model, symlib.spec_of(model, SHAPE), torch.randn(32, *SHAPE, dtype=torch.float64)
    transformers = pytest.importorskip("transformers")
    tokens = torch.randint(0, 50, (16, 8), generator=torch.Generator().manual_seed(1))
    if name == "hf-vit":
        cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, image_size=14, patch_size=7, num_channels=1,
                                     num_labels=10)
        model = transformers.ViTForImageClassification(cfg).double().eval()
        return model, symlib.spec_of(model, (1, 14, 14)), torch.randn(16, 1, 14, 14, dtype=torch.float64)
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=50, n_positions=16)
        model = transformers.GPT2LMHeadModel(cfg).double().eval()
    elif name == "t5":
        cfg = transformers.T5Config(d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2, vocab_size=50,
                                    relative_attention_num_buckets=8)
        model = transformers.T5EncoderModel(cfg).double().eval()
    else:
        cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=64, vocab_size=50,
                                       max_position_embeddings=32)
        model = transformers.LlamaForCausalLM(cfg).double().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, symlib.spec_of(model, (8,), vocab=50), tokens


@pytest.mark.parametrize("name", ["grouped", "tinyvit", "hf-vit", "gpt2", "llama", "t5"])
def test_activation_matching_moves_heads_and_groups_as_blocks(name):
    """Labels with blocks (attention heads, with rotary heads and grouped-query attention in Llama; the
    groups of a grouped convolution; T5's position-bias table, which follows the heads): a copy permuted by
    a random element of the group, which moves whole blocks and the features inside them, comes back
    exactly by activation matching; on the command line a text model is matched on random token ids."""
    from symlib.cli.merge import MATCHING_TOKENS, matching_batch

    model, spec, x = _transformer(name)
    if spec.vocab is not None:
        tokens = matching_batch(spec)
        assert tokens.shape == (MATCHING_TOKENS, *spec.input_shape) and not tokens.is_floating_point()
        assert 0 <= int(tokens.min()) and int(tokens.max()) < spec.vocab
    assert spec.blocks
    theta = {k: v.detach().clone() for k, v in model.state_dict().items()}
    moved = _permuted(theta, spec, seed=3)
    assert _maxdiff(moved, theta) > 1e-2
    back = symlib.merge(theta, moved, spec, how="activations", batch=x, model=model, t=1.0)
    assert _maxdiff(back, theta) == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_the_barrier_of_a_network_with_itself_is_zero(arch, trained):
    model, _, (a, _) = trained[arch]
    a64 = {k: v.double() if v.is_floating_point() else v for k, v in a.items()}
    for align in ("none", "weights"):
        res = symlib.barrier(a64, a64, model, align=align, n_points=5)  # the embedded test digits
        assert abs(res.loss_barrier) < 1e-9 and res.accuracy_barrier == 0.0
        assert res.t == (0.0, 0.25, 0.5, 0.75, 1.0) and res.n == 1000


def test_the_ends_are_the_networks_and_a_batch_of_ones_own_works(trained):
    from symlib.stats.barrier import evaluate

    model, spec, (a, b) = trained["cnn"]
    test = data.load("mnist", "test")
    x, y = test.x[:300], test.y[:300]
    ends = evaluate(model, a, x, y), evaluate(model, b, x, y)
    for align in ("none", "weights", "activations"):
        res = symlib.barrier(a, b, model, (x, y), spec, align=align, n_points=3)
        assert res.n == 300
        assert res.loss[0] == pytest.approx(ends[0][0], abs=1e-6)
        assert res.loss[-1] == pytest.approx(ends[1][0], abs=1e-4)  # b's function is unchanged
        assert (res.accuracy[0], res.accuracy[-1]) == pytest.approx((ends[0][1], ends[1][1]), abs=1 / 300)
        assert res.loss_barrier >= 0 and res.accuracy_barrier >= 0
    with pytest.raises(ValueError, match="n_points"):
        symlib.barrier(a, b, model, (x, y), spec, n_points=1)
    with pytest.raises(ValueError, match="network takes"):
        symlib.barrier(a, b, model, (torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.long)), spec)


def test_weight_matching_lowers_the_barrier_of_independent_mlps(digits):
    """Three pairs of independently trained MLPs: the plain path climbs over a clear bump, the path after
    weight matching stays far lower (measured: 0.9-1.0 nats plain, at most 0.01 after matching)."""
    model = DigitMLP()
    spec = symlib.spec_of(model, SHAPE)
    test = data.load("mnist", "test")
    for s in (10, 12, 14):
        a, b = _train("mlp", s, digits, steps=300), _train("mlp", s + 1, digits, steps=300)
        plain = symlib.barrier(a, b, model, (test.x, test.y), spec, align="none")
        matched = symlib.barrier(a, b, model, (test.x, test.y), spec, align="weights")
        assert plain.loss_barrier > 0.1, plain
        assert matched.loss_barrier < 0.5 * plain.loss_barrier, (plain, matched)
        assert matched.accuracy_barrier <= plain.accuracy_barrier + 1e-9


def test_orthogonal_leaves_a_network_without_a_stream_alone(trained, digits):
    model, spec, (a, b) = trained["mlp"]
    assert _maxdiff(symlib.merge(a, b, spec, orthogonal=True), symlib.merge(a, b, spec)) == 0


def test_orthogonal_merges_a_transformer_with_a_rotated_copy_back():
    """A pre-norm transformer and a copy whose residual stream is rotated (the same function): the plain
    average mixes the two bases, ``orthogonal=True`` rotates the copy back first and returns the original."""
    from transformer_nets import build

    from symlib.symmetry import stream

    model, shape, _ = build("tv-vit", seed=0)
    spec = symlib.spec_of(model, shape)
    theta = {k: v.detach().clone() for k, v in model.state_dict().items()}
    (label,) = stream.stream_labels(spec)
    q = stream.random_orthogonal(spec.perms[label], fix_ones=True, generator=torch.Generator().manual_seed(1))
    turned = stream.rotate(theta, spec, label, q)
    x = torch.randn(16, *shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    torch.testing.assert_close(spec.forward(turned, x), spec.forward(theta, x), rtol=1e-9, atol=1e-9)
    assert _maxdiff(symlib.merge(theta, turned, spec, how="none"), theta) > 1e-2
    assert _maxdiff(symlib.merge(theta, turned, spec, how="none", orthogonal=True), theta) < 1e-9
    moved = _permuted(theta, spec, seed=1)  # permutations first, then the rotation (none left to find)
    assert _maxdiff(symlib.merge(theta, moved, spec, how="weights", orthogonal=True), theta) < 1e-9


# ----------------------------------------------------------------------------- command line
@pytest.fixture(scope="module")
def files(trained, tmp_path_factory):
    root = tmp_path_factory.mktemp("merge")
    _, _, (a, b) = trained["mlp"]
    torch.save(a, root / "a.pt")
    torch.save(b, root / "b.pt")
    return root


MODEL = ["--model", f"{NETS}:DigitMLP", "--input-shape", "1,28,28"]


def _run(argv, capsys):
    rc = cli.main([str(v) for v in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_the_command_line_offers_every_way_of_matching():
    from symlib.cli import merge as cli_merge
    from symlib.symmetry import merge as merging

    assert cli_merge.HOWS == merging.HOWS


@pytest.mark.parametrize("how", ["none", "weights", "activations"])
def test_cli_merge_writes_what_python_merges(how, files, trained, digits, tmp_path, capsys):
    model, spec, (a, b) = trained["mlp"]
    argv = ["merge", files / "a.pt", files / "b.pt", "--to", tmp_path / "m", "--how", how, *MODEL]
    rc, out, err = _run(argv, capsys)
    assert rc == 0, err
    params, man = symlib.load(tmp_path / "m")
    assert man["n_samples"] == 1 and man["method"] == "merge" and man["source"]["how"] == how
    want = symlib.merge(a, b, spec, how=how, batch=digits.x, model=model)
    got = symlib.params.unstack(params, 0)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    # the merged folder records its network: symlib barrier reads it without --model
    rc, out, err = _run(["barrier", tmp_path / "m", tmp_path / "m", "--how", "none", "--json"], capsys)
    assert rc == 0, err
    assert abs(json.loads(out)["results"][0]["loss_barrier"]) < 1e-6


def test_cli_merge_never_overwrites(files, tmp_path, capsys):
    argv = ["merge", files / "a.pt", files / "b.pt", *MODEL]
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("mine too")
    for out in (tmp_path / "taken", tmp_path / "file"):
        rc, _, err = _run([*argv, "--to", out], capsys)
        assert rc == 2 and "already exists" in err and "nothing is overwritten" in err
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in (tmp_path / "taken").iterdir()) == ["notes.txt"]
    assert (tmp_path / "file").read_text() == "mine too"
    assert _run([*argv, "--to", tmp_path / "m"], capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()}
    rc, _, err = _run([*argv, "--to", tmp_path / "m", "--how", "none"], capsys)  # not even its own output
    assert rc == 2 and "already exists" in err
    assert {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()} == before


def test_cli_merge_refuses_a_set_of_several_networks(files, tmp_path, capsys):
    rc, _, err = _run(["merge", files, files / "b.pt", "--to", tmp_path / "m", *MODEL], capsys)
    assert rc == 2 and "holds 2 networks" in err and not (tmp_path / "m").exists()


def test_cli_barrier_json_equals_python(files, trained, digits, capsys):
    model, spec, (a, b) = trained["mlp"]
    rc, out, err = _run(["barrier", files / "a.pt", files / "b.pt", "--how", "none,weights,activations",
                         "--points", "5", "--json", *MODEL], capsys)
    assert rc == 0, err
    got = json.loads(out)["results"]
    assert [r["align"] for r in got] == ["none", "weights", "activations"]
    for r in got:
        want = symlib.barrier(a, b, model, spec=spec, align=r["align"], n_points=5, batch=digits.x).to_dict()
        assert set(r) == set(want) and (r["n"], r["t"]) == (want["n"], want["t"])
        for k in ("loss", "accuracy", "loss_barrier", "accuracy_barrier"):
            assert r[k] == pytest.approx(want[k], rel=1e-9, abs=1e-12), k
    rc, out, err = _run(["barrier", files / "a.pt", files / "b.pt", *MODEL], capsys)
    assert rc == 0 and "loss barrier" in out and "weights" in out, err
    rc, _, err = _run(["barrier", files / "a.pt", files / "b.pt", "--how", "sideways", *MODEL], capsys)
    assert rc == 2 and "none,weights" in err


@pytest.mark.parametrize("group", ["merge", "barrier"])
def test_help(group, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([group, "--help"])
    assert e.value.code == 0 and "--how" in capsys.readouterr().out


def test_orthogonal_also_turns_each_head_back():
    """A copy whose stream is rotated and whose every head is turned by an orthogonal matrix (queries and
    keys by one, values and outputs by another: the same function) merges back to the original."""
    from transformer_nets import build

    from symlib.symmetry import continuous, stream

    model, shape, _ = build("tv-vit", seed=0)
    spec = symlib.spec_of(model, shape)
    theta = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(3)
    (label,) = stream.stream_labels(spec)
    turned = stream.rotate(theta, spec, label, stream.random_orthogonal(spec.perms[label], True, gen))
    mats = {}
    for lab in spec.continuous:
        g, k = spec.blocks[lab][0], spec.perms[lab] // spec.blocks[lab][0]
        mats[lab] = torch.linalg.qr(torch.randn(g, k, k, generator=gen, dtype=torch.float64))[0]
    turned = continuous.act(turned, spec, mats)
    x = torch.randn(8, *shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    torch.testing.assert_close(spec.forward(turned, x), spec.forward(theta, x), rtol=1e-9, atol=1e-9)
    back = continuous.align_heads(theta, turned, spec)
    torch.testing.assert_close(spec.forward(back, x), spec.forward(theta, x), rtol=1e-9, atol=1e-9)
    assert _maxdiff(back, theta) > 1e-2  # the stream still turned: the heads alone cannot undo it
    assert _maxdiff(symlib.merge(theta, turned, spec, how="none", orthogonal=True, orthogonal_rounds=30),
                    theta) < 1e-9


def test_orthogonal_on_a_spec_without_scalings_is_refused_not_skipped():
    """A transformer traced with scalings='none' has lost what locates its stream: rotating it is refused
    with the fix, not silently skipped."""
    from transformer_nets import build

    model, shape, _ = build("tv-vit", seed=0)
    spec = symlib.spec_of(model, shape, scalings="none")
    theta = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with pytest.raises(symlib.SymmetryError, match="scalings='partial'"):
        symlib.merge(theta, theta, spec, how="none", orthogonal=True)
