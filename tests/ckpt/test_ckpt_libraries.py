"""Checkpoints written by the real libraries: Lightning's Trainer, transformers' save_pretrained (sharded,
tied weights, hf:// repositories) and timm; each read equal to what the library itself loads."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from ckpt_nets import INPUT_SHAPE, SmallNet

import symlib
from symlib.ckpt import loader, recipe

ROOT = Path(__file__).resolve().parents[2]


def _rows_equal(params, states):
    for i, sd in enumerate(states):
        assert set(params) == set(sd)
        for k, v in sd.items():
            assert torch.equal(params[k][i], v), (i, k)


def test_lightning_trainer_checkpoints(tmp_path):
    L = pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Lit(L.LightningModule):
        def __init__(self, lr: float = 0.1):
            super().__init__()
            self.save_hyperparameters()
            self.model = SmallNet()

        def training_step(self, batch, _):
            x, y = batch
            return F.cross_entropy(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, *INPUT_SHAPE, generator=g), torch.randint(0, 3, (8,), generator=g)
    data = torch.utils.data.TensorDataset(x, y)
    trained = []
    for seed in range(2):
        torch.manual_seed(seed)
        lit = Lit()
        trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=tmp_path,
                            callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpts", filename=f"seed{seed}")])
        trainer.fit(lit, torch.utils.data.DataLoader(data, batch_size=4))
        trainer.save_checkpoint(tmp_path / "saved" / f"seed{seed}.ckpt")  # Lightning's own saving API
        trained.append({k: v.detach().clone() for k, v in lit.model.state_dict().items()})
    for folder in ("ckpts", "saved"):
        got = loader.read(tmp_path / folder)  # the LightningModule's attribute found without the model
        assert (got.key, got.prefix, got.files[0]["kind"]) == ("state_dict", "model.", "lightning")
        _rows_equal(got.params, trained)
        _rows_equal(symlib.load_checkpoints(str(tmp_path / folder / "*.ckpt"), model=SmallNet()), trained)


@pytest.fixture(scope="module")
def bert_seeds(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("bert")
    cfg = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=24, max_position_embeddings=24)
    for seed in range(3):
        torch.manual_seed(seed)
        model = transformers.BertForMaskedLM(cfg)  # ties the decoder to the word embeddings
        model.save_pretrained(root / f"seed{seed}", max_shard_size="4KB")  # forces shards and an index
    return root


def test_transformers_sharded_folders_with_tied_weights(bert_seeds):
    import transformers

    assert (bert_seeds / "seed0" / "model.safetensors.index.json").is_file()
    assert len(list((bert_seeds / "seed0").glob("model-*-of-*.safetensors"))) > 1
    load = transformers.BertForMaskedLM.from_pretrained
    want = [load(bert_seeds / f"seed{s}").state_dict() for s in range(3)]
    got = loader.read(bert_seeds)  # a folder of model folders, their config.json naming the architecture
    assert got.recipe.builder == "transformers" and got.recipe.target == "BertForMaskedLM"
    shards = list((bert_seeds / "seed0").glob("*.safetensors"))
    assert got.counts == [1, 1, 1] and len(got.files) == 3 * len(shards)
    _rows_equal(got.params, [{k: v for k, v in sd.items()} for sd in want])
    tied = "cls.predictions.decoder.weight"
    assert torch.equal(got.params[tied], got.params["bert.embeddings.word_embeddings.weight"])
    # another architecture among them is named
    odd = bert_seeds.parent / "odd"
    shutil.copytree(bert_seeds / "seed0", odd / "a")
    cfg = transformers.BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=24, max_position_embeddings=24)
    transformers.BertForMaskedLM(cfg).save_pretrained(odd / "b")
    with pytest.raises(symlib.ckpt.CheckpointError, match=r"b: another architecture than .*a \(config\.json "
                                                          r"differs: hidden_size\)"):
        loader.read(odd)


def _hub_cache(root: Path, repo: str, folder: Path, commit: str = "1" * 40) -> None:
    """A Hugging Face Hub cache holding ``folder`` as model ``repo``, as ``hf download`` leaves it."""
    base = root / f"models--{repo.replace('/', '--')}"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    (base / "blobs").mkdir()
    for f in folder.iterdir():
        blob = base / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))


@pytest.mark.slow
def test_hf_model_repositories_through_the_hub_cache_offline(bert_seeds, tmp_path):
    cache = tmp_path / "hub"
    for s in range(2):
        _hub_cache(cache, f"owner/bert-seed{s}", bert_seeds / f"seed{s}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    code = ("import sys, torch, symlib, symlib.cli; p = symlib.load_checkpoints(['hf://owner/bert-seed0', "
            "'hf://owner/bert-seed1@main']); torch.save(p, sys.argv[1]); "
            "print('rc', symlib.cli.main(['import', 'hf://owner/elsewhere', '--to', sys.argv[2]]))")
    argv = [sys.executable, "-c", code, str(tmp_path / "p.pt"), str(tmp_path / "out")]
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    got = torch.load(tmp_path / "p.pt")
    ref = symlib.load_checkpoints([bert_seeds / "seed0", bert_seeds / "seed1"])
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    assert "rc 2" in done.stdout and "cannot resolve the model repository" in done.stderr
    assert not (tmp_path / "out").exists()


def test_timm_state_dicts_and_hub_folders(tmp_path):
    timm = pytest.importorskip("timm")
    from timm.models import save_for_hf

    nets = []
    for seed in range(2):
        torch.manual_seed(seed)
        net = timm.create_model("test_resnet", num_classes=5)
        nets.append(net)
        torch.save(net.state_dict(), tmp_path / f"seed{seed}.pth")
        save_for_hf(net, tmp_path / "hub" / f"seed{seed}", safe_serialization=True)
    args = {"model_name": "test_resnet", "num_classes": 5}
    got = loader.read(str(tmp_path / "seed*.pth"), model="timm:create_model", model_args=args)
    states = [n.state_dict() for n in nets]
    _rows_equal(got.params, states)
    # timm reads the same files into the same weights
    for i in range(2):
        overlay = {"file": str(tmp_path / f"seed{i}.pth"), "num_classes": 5}
        again = timm.create_model("test_resnet", True, pretrained_cfg_overlay=overlay, num_classes=5)
        assert all(torch.equal(got.params[k][i], v) for k, v in again.state_dict().items())
    # timm's Hub folders name their architecture and input size in config.json
    hub = loader.read(tmp_path / "hub")
    rec = hub.recipe
    assert (rec.builder, rec.target, rec.input_shape) == ("timm", "test_resnet", (3, 160, 160))
    _rows_equal(hub.params, states)
    spec = recipe.spec(hub.recipe)
    theta = symlib.params.cast(symlib.params.unstack(hub.params, 0), torch.float64)
    assert symlib.assert_same_function(spec, theta, symlib.canonicalize(theta, spec)) < 1e-9
