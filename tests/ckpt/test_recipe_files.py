"""A network named by its file: the set records the file's path relative to the set and its sha256, finds
the file when set and file move together, and names the file and ``--model`` when it is gone or changed;
a model module or factory that calls ``sys.exit`` is a clear error, not an exit."""

from __future__ import annotations

import hashlib
import shutil

import pytest
import torch

import symlib
from symlib.ckpt import convert
from symlib.errors import CheckpointError
from symlib.models import Recipe, load_factory

NET = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(3, 4)
        self.fc2 = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))
'''


def _set(project):
    """A project folder holding nets.py and an imported set of 3 networks written from it."""
    (project / "nets.py").write_text(NET)
    recipe = Recipe.of(f"{project / 'nets.py'}:Net", input_shape=(3,))
    nets = [recipe.build() for _ in range(3)]
    params = {k: torch.stack([n.state_dict()[k] for n in nets]) for k in nets[0].state_dict()}
    convert.write(params, project / "set", recipe)
    return params


def test_the_set_records_its_model_file_and_finds_it_moved(tmp_path):
    (tmp_path / "project").mkdir()
    params = _set(tmp_path / "project")
    man = symlib.store.read_manifest(tmp_path / "project" / "set")
    file = man["architecture"]["file"]
    assert file == {"relative": "../nets.py",
                    "sha256": hashlib.sha256((tmp_path / "project" / "nets.py").read_bytes()).hexdigest()}
    shutil.move(tmp_path / "project", tmp_path / "moved")  # the project moves, set and file together
    nets, _ = symlib.load(tmp_path / "moved" / "set", as_="models")
    assert all(torch.equal(net.state_dict()[k], params[k][i]) for i, net in enumerate(nets) for k in params)
    assert str(tmp_path / "moved" / "nets.py") in str(symlib.store.architecture(
        symlib.store.read_manifest(tmp_path / "moved" / "set"), str(tmp_path / "moved" / "set")).target)


def test_a_lost_or_changed_model_file_is_named_with_the_override(tmp_path):
    (tmp_path / "project").mkdir()
    params = _set(tmp_path / "project")
    shutil.move(tmp_path / "project" / "nets.py", tmp_path / "renamed.py")  # the file alone moves: lost
    with pytest.raises(CheckpointError, match=r"nets\.py .*is not found.*--model path/to/file\.py:Net"):
        symlib.load(tmp_path / "project" / "set", as_="models")
    # the file given as the model: used, and the weights load
    got = symlib.load_checkpoints(tmp_path / "project" / "set", model=f"{tmp_path / 'renamed.py'}:Net")
    assert all(torch.equal(got[k], params[k]) for k in params)
    shutil.move(tmp_path / "renamed.py", tmp_path / "project" / "nets.py")
    (tmp_path / "project" / "nets.py").write_text(NET.replace("torch.relu", "torch.tanh"))  # same shapes
    with pytest.raises(CheckpointError, match=r"changed since the set was written.*--model"):
        symlib.load(tmp_path / "project" / "set", as_="models")


def test_a_model_that_calls_sys_exit_is_an_error(tmp_path):
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(CheckpointError, match=r"called sys\.exit\(3\).*__main__"):
        load_factory(f"{tmp_path / 'exits.py'}:Net")
    (tmp_path / "factory.py").write_text("import sys\n\ndef make():\n    sys.exit('no GPU')\n")
    with pytest.raises(CheckpointError, match=r"called sys\.exit\('no GPU'\).*return an nn\.Module"):
        Recipe.of(f"{tmp_path / 'factory.py'}:make").build()
