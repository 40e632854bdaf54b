"""Single flipped bytes in every kind of file symlib reads as checkpoints: each read gives exactly the
original tensors (a byte that does not matter: zip padding, an unread optimizer state, a name nobody reads)
or a clear error naming the file (a :class:`ValueError`: ``CheckpointError``, ``StoreError``), never
another exception and never other weights returned silently.

A ``.safetensors`` file has no checksum of its tensors' bytes: a flip inside its data section changes one
weight and cannot be detected, so for that kind (and Hugging Face folders of it) a third outcome is
accepted, only for flips inside the data section: the weights differ at the flipped element alone.
Symlib folders (sample sets, zoo chunks, exported datasets) record the sha256 of every tensor: every flip
that changes a weight is an error."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import struct
from pathlib import Path

import pytest
import torch
from ckpt_nets import SmallNet, trained
from safetensors.torch import save_file

import symlib
import symlib.cli
from symlib.posteriors import SampleSet, io

FLIPS = 30  # per kind
SEEDS = {"pt": 1, "ckpt": 2, "safetensors": 3, "hf": 4}


def _flip(rng: random.Random, size: int, anywhere: bool) -> tuple[int, int]:
    """A seeded ``(position, xor mask)`` in a file of ``size`` bytes: anywhere, or in its first or last 512
    bytes (headers, a zip archive's directories), where a flip is most often a damaged structure."""
    ends = [*range(min(512, size)), *range(max(0, size - 512), size)]
    return rng.randrange(size) if anywhere else rng.choice(ends), rng.randrange(1, 256)


def _flips(size: int, seed: int, n: int = FLIPS) -> list[tuple[int, int]]:
    """``n`` flips (:func:`_flip`), half of them anywhere."""
    rng = random.Random(seed)
    return [_flip(rng, size, anywhere=i % 2 == 1) for i in range(n)]


def _flipped(file: Path, pos: int, mask: int, original: bytes) -> None:
    raw = bytearray(original)
    raw[pos] ^= mask
    file.write_bytes(bytes(raw))


def _read(path: Path, read) -> dict[str, torch.Tensor] | None:
    """What ``read(path)`` gives: the tensors, or ``None`` for a clear error (it must name ``path``); any
    other exception fails the test with its traceback."""
    try:
        return read(path)
    except ValueError as e:  # CheckpointError, StoreError, DamagedError
        msg = str(e)
        assert path.name in msg and "\n" not in msg.strip(), msg
        return None


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(
        got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)


def _one_element(got, want, name: str, index: int) -> bool:
    """Whether ``got`` differs from ``want`` at element ``index`` of row 0 of tensor ``name`` alone."""
    if got.keys() != want.keys() or any(got[k].dtype != want[k].dtype for k in want):
        return False
    if not all(torch.equal(got[k], want[k]) for k in want if k != name):
        return False
    a, b = got[name][0].flatten().clone(), want[name][0].flatten()
    if a.shape != b.shape:
        return False
    a[index] = b[index]
    return torch.equal(a, b)


def _element_at(data: bytes, pos: int) -> tuple[str, int] | None:
    """The tensor and element whose bytes hold byte ``pos`` of a safetensors file (``None``: the header)."""
    n = int.from_bytes(data[:8], "little")
    if pos < 8 + n:
        return None
    header = json.loads(data[8:8 + n])
    for name, rec in header.items():
        if name == "__metadata__":
            continue
        begin, end = rec["data_offsets"]
        if begin <= pos - 8 - n < end:
            item = {"F32": 4, "I64": 8}[rec["dtype"]]
            return name, (pos - 8 - n - begin) // item
    raise AssertionError(f"byte {pos} belongs to no tensor")


def _checkpoints(path: Path) -> dict[str, torch.Tensor]:
    return symlib.load_checkpoints(path, model=SmallNet())


def _lightning(sd: dict[str, torch.Tensor]) -> dict:
    """A Lightning-style checkpoint: the weights under ``state_dict`` with a prefix, an optimizer's state
    (tensors that are never read) beside them."""
    net = SmallNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(0))).sum().backward()
    opt.step()
    return {"state_dict": {f"model.{k}": v for k, v in sd.items()}, "epoch": 3, "global_step": 12,
            "optimizer_states": [opt.state_dict()]}


def _hf_folder(folder: Path, sd: dict[str, torch.Tensor]) -> None:
    """A Hugging Face-style model folder, as ``save_pretrained`` writes it (no download)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "smallnet", "architectures": ["SmallNet"],
                                                    "hidden_size": 4}, indent=2))
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("kind", ["pt", "ckpt", "safetensors", "hf"])
def test_flipped_bytes_in_checkpoint_files_are_the_original_weights_or_an_error(kind, tmp_path):
    sd = trained(0)
    if kind == "hf":
        path = tmp_path / "hf-model"
        _hf_folder(path, sd)
        files = [path / "config.json", path / "model.safetensors"]
    else:
        path = tmp_path / f"net.{kind}"
        if kind == "safetensors":
            save_file(sd, path)
        else:
            torch.save(_lightning(sd) if kind == "ckpt" else sd, path)
        files = [path]
    want = _checkpoints(path)
    assert _same(want, {k: v[None] for k, v in sd.items()})
    originals = {f: f.read_bytes() for f in files}
    outcomes = {"same": 0, "error": 0, "one weight": 0}
    sizes = [len(b) for b in originals.values()]
    for i, (pos, mask) in enumerate(_flips(sum(sizes), seed=SEEDS[kind])):
        file, at = files[0], pos
        if at >= sizes[0]:
            file, at = files[1], at - sizes[0]
        _flipped(file, at, mask, originals[file])
        got = _read(path, _checkpoints)
        file.write_bytes(originals[file])
        if got is None:
            outcomes["error"] += 1
        elif _same(got, want):
            outcomes["same"] += 1
        else:
            where = _element_at(originals[file], at) if file.suffix == ".safetensors" else None
            assert where is not None and _one_element(got, want, *where), (
                f"flip {i}: byte {at} of {file.name} ^ {mask:#04x} returned other weights silently")
            outcomes["one weight"] += 1
    assert outcomes["error"] > 0, outcomes
    if kind in ("pt", "ckpt"):
        assert outcomes["one weight"] == 0, outcomes


# --------------------------------------------------------------------------- damage that is never silent
def _zip_records(data: bytes) -> dict[str, tuple[int, int]]:
    """``{name: (where its bytes start, size)}`` of a zip archive's records."""
    import io as _io
    import zipfile

    out = {}
    with zipfile.ZipFile(_io.BytesIO(data)) as z:
        for info in z.infolist():
            nlen, elen = struct.unpack_from("<HH", data, info.header_offset + 26)
            out[info.filename] = (info.header_offset + 30 + nlen + elen, info.file_size)
    return out


def test_a_flipped_bit_in_a_weight_of_a_torch_file_fails_its_crc(tmp_path):
    sd = trained(1)
    path = tmp_path / "net.pt"
    torch.save(sd, path)
    data = path.read_bytes()
    name, (start, size) = next((k, v) for k, v in _zip_records(data).items() if k.endswith("data/0"))
    raw = bytearray(data)
    raw[start + size // 2] ^= 0x01  # one bit of the mantissa: a plausible weight
    path.write_bytes(bytes(raw))
    with pytest.raises(symlib.ckpt.CheckpointError, match=r"net\.pt: tensor storage '0': its bytes do not "
                                                          r"match the CRC-32 .*copy or save it again"):
        _checkpoints(path)
    # a memory-mapped file (above lazy.MMAP_ABOVE): the same check, on a view of the mapped bytes
    big = {"w": torch.randn(1 << 20, 3), "b": torch.randn(5)}
    torch.save(big, path)
    assert path.stat().st_size > symlib.ckpt.lazy.MMAP_ABOVE
    assert all(torch.equal(v[0], big[k]) for k, v in symlib.load_checkpoints(path).items())
    start, size = next(v for k, v in _zip_records(path.read_bytes()).items() if k.endswith("data/0"))
    with open(path, "r+b") as f:
        f.seek(start + size - 3)
        byte = f.read(1)
        f.seek(start + size - 3)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(symlib.ckpt.CheckpointError, match=r"net\.pt: tensor storage '0': its bytes do not "):
        symlib.load_checkpoints(path)
    # also when the file needs torch.load (a name the weights-only reader does not know): checked before
    torch.save({"state_dict": sd, "args": torch.Size([3])}, path)
    data = bytearray(path.read_bytes())
    start, size = next(v for k, v in _zip_records(bytes(data)).items() if k.endswith("data/0"))
    data[start] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(symlib.ckpt.CheckpointError, match=r"net\.pt: record .*data/0.* fails its CRC-32"):
        _checkpoints(path)


def _safetensors(tmp_path: Path, header: dict, data: bytes) -> Path:
    path = tmp_path / "bad.safetensors"
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize(("offsets", "match"), [  # [begin, end, elements (default: (end - begin) / 4)]
    ({"a": [-4, 12, 4], "b": [12, 28]}, r"tensor 'a': its byte range \[-4, 12\) is negative"),
    ({"a": [0, 16], "b": [8, 24]}, r"tensor 'b': its byte range \[8, 24\) overlaps the one of tensor 'a'"),
    ({"a": [16, 32], "b": [0, 16]}, None),  # any order on disk is fine
    ({"a": [0, 12], "b": [16, 32]}, r"tensor 'b': .* leaves bytes \[12, 16\) of the data section to no"),
    ({"a": [0, 16], "b": [16, 32, 6]}, r"tensor 'b': its byte range \[16, 32\) holds 16 bytes, but .* "
     r"need 24"),
    ({"a": [0, 16], "b": [16, 32], "c": [32, 32]}, None),  # an empty tensor at the end
    ({"a": [0, 16], "b": [16, 40]}, r"tensor 'b': .* ends beyond the 32 bytes of the data section"),
    ({"a": [0, 16], "b": [12, 12]}, r"tensor 'b': .* overlaps"),
    ({"a": [16, 12, 0], "b": [0, 16]}, r"tensor 'a': .* ends before it begins"),
    ({"a": [0, 16]}, r"tensor 'a': the last byte range ends at 16, but the data section holds 32 bytes"),
])
def test_safetensors_byte_ranges_are_checked(tmp_path, offsets, match):
    header = {k: {"dtype": "F32", "shape": [v[2] if len(v) > 2 else max(0, (v[1] - v[0]) // 4)],
                  "data_offsets": v[:2]} for k, v in offsets.items()}
    path = _safetensors(tmp_path, header, torch.arange(8.0).numpy().tobytes())
    read = symlib.ckpt.loader.read
    if match is None:
        got = read(path).params
        lo = {k: v[0] // 4 for k, v in offsets.items()}
        assert all(torch.equal(got[k][0], torch.arange(8.0)[lo[k]:lo[k] + got[k].shape[1]]) for k in got)
        return
    with pytest.raises(symlib.ckpt.CheckpointError, match=r"bad\.safetensors: not a valid safetensors file "
                                                          r"\(" + match):
        read(path)


def test_trailing_bytes_and_bad_headers_of_safetensors_files(tmp_path):
    f32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    cases = [
        ({"a": {**f32, "shape": [-2]}}, b"\0" * 8, r"tensor 'a': unknown dtype or bad record"),
        ({"a": {**f32, "data_offsets": [0.0, 8.0]}}, b"\0" * 8, r"tensor 'a': unknown dtype or bad record"),
        ({"a": {**f32, "dtype": "F33"}}, b"\0" * 8, r"tensor 'a': unknown dtype or bad record"),
        ({"a": [1, 2]}, b"\0" * 8, r"tensor 'a': unknown dtype or bad record"),
    ]
    for header, data, match in cases:
        with pytest.raises(symlib.ckpt.CheckpointError, match=match):
            symlib.load_checkpoints(_safetensors(tmp_path, header, data))
    path = tmp_path / "bad.safetensors"
    for raw, match in ((b"{not json", "its header is not JSON"), (b"\xff\xfe{}", "its header is not JSON"),
                       (b"[1, 2]", "its header is not a JSON object")):
        path.write_bytes(struct.pack("<Q", len(raw)) + raw)
        with pytest.raises(symlib.ckpt.CheckpointError, match=r"bad\.safetensors: .*" + match):
            symlib.load_checkpoints(path)
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(symlib.ckpt.CheckpointError, match=r"header claims 1099511627776 bytes, the file has "
                                                          r"10: a truncated file"):
        symlib.load_checkpoints(path)


@pytest.mark.parametrize("suffix", [".pt", ".ckpt", ".bin"])
def test_empty_text_and_truncated_torch_files_are_clear_errors(suffix, tmp_path):
    path = tmp_path / f"net{suffix}"
    path.write_bytes(b"")
    with pytest.raises(symlib.ckpt.CheckpointError, match=r"net\.\w+: an empty file \(0 bytes\), not a "
                                                          r"checkpoint.*save or copy it again"):
        _checkpoints(path)
    path.write_text("epoch,loss\n1,0.5\n")
    with pytest.raises(symlib.ckpt.CheckpointError, match=r"not a file torch.load can read .*starts with "
                                                          r"b'epoch,lo', neither a zip archive.*not a "
                                                          r"checkpoint"):
        _checkpoints(path)
    sd = trained(2)
    for legacy in (False, True):
        torch.save(sd, path, _use_new_zipfile_serialization=not legacy)
        data = path.read_bytes()
        for cut in (3, 100, len(data) // 2, len(data) - 40):
            path.write_bytes(data[:cut])
            with pytest.raises(symlib.ckpt.CheckpointError, match=rf"net\{suffix}: .*(damaged|truncated)"):
                _checkpoints(path)
    safetensors = tmp_path / "s.safetensors"
    save_file(sd, safetensors)
    path.write_bytes(safetensors.read_bytes())
    with pytest.raises(symlib.ckpt.CheckpointError, match=r"looks like a safetensors file: name it"):
        _checkpoints(path)


def test_truncated_safetensors_files_are_clear_errors(tmp_path):
    path = tmp_path / "net.safetensors"
    save_file(trained(3), path)
    data = path.read_bytes()
    for cut in (0, 5, 8, 40, len(data) // 2, len(data) - 1):
        path.write_bytes(data[:cut])
        with pytest.raises(symlib.ckpt.CheckpointError, match=r"net\.safetensors: not a valid safetensors "
                                                              r"file .*truncated"):
            _checkpoints(path)


NETS = str(Path(__file__).resolve().parents[1] / "ckpt_nets.py")


@pytest.mark.parametrize("case", ["negative", "overlap", "crc", "empty", "text"])
def test_symlib_import_refuses_damaged_files_in_one_line_and_writes_nothing(case, tmp_path, capsys):
    """The files a user found: ``symlib import`` wrote them with rc 0 or showed a raw traceback."""
    sd = trained(4)
    if case in ("negative", "overlap"):
        path = tmp_path / "net.safetensors"
        save_file(sd, path)
        data = path.read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        begin, end = header["conv1.weight"]["data_offsets"]
        shift = -begin - 8 if case == "negative" else (16 if begin == 0 else -16)
        header["conv1.weight"]["data_offsets"] = [begin + shift, end + shift]
        path = _safetensors(tmp_path, header, data[8 + n:])
        match = r"bad\.safetensors: not a valid safetensors file \(tensor 'conv1\.weight'"
    else:
        path = tmp_path / "net.pt"
        torch.save(sd, path)
        if case == "crc":
            start, size = next(v for k, v in _zip_records(path.read_bytes()).items() if k.endswith("data/0"))
            raw = bytearray(path.read_bytes())
            raw[start + 1] ^= 0x04
            path.write_bytes(bytes(raw))
        else:
            path.write_bytes(b"" if case == "empty" else b"epoch 3: loss 0.25\n")
        match = {"crc": r"net\.pt: tensor storage '0': its bytes do not match the CRC-32",
                 "empty": r"net\.pt: an empty file",
                 "text": r"net\.pt: not a file torch\.load can read"}[case]
    out = tmp_path / "out"
    rc = symlib.cli.main(["import", str(path), "--to", str(out), "--model", f"{NETS}:SmallNet"])
    err = capsys.readouterr().err.strip()
    first = err.splitlines()[0]
    assert rc != 0 and first.startswith("symlib: error: ") and "Traceback (most recent" not in err, err
    assert re.search(match, first), err
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


# ------------------------------------------------------------------------------------------ symlib folders
def _sample_set() -> SampleSet:
    g = torch.Generator().manual_seed(0)
    shapes = {"conv.weight": (2, 1, 3, 3), "fc.weight": (3, 4), "fc.bias": (3,)}
    return SampleSet({k: torch.randn(4, *v, generator=g) for k, v in shapes.items()}, "swag", 2, 2,
                     hyper={"scale": 0.1}, base_seeds=[7, 8])


def _load(path: Path) -> dict[str, torch.Tensor]:
    return symlib.load(path)[0]


def _tiny_zoo(out: Path) -> Path:
    """Two OptuNets of the tiny MNIST preset, one per chunk, 64 training digits, one epoch (a second)."""
    base = symlib.zoo.preset("mnist-optunet", "tiny")
    cfg = dataclasses.replace(base, n_models=2, chunk=1, n_train=64, n_test=32, recipe=base.recipe.scaled(1))
    symlib.zoo.train(cfg, out, progress=False)
    return out


@pytest.mark.parametrize("kind", ["zoo", "samples", "dataset"])
def test_flipped_bytes_in_symlib_folders_are_the_original_weights_or_an_error(kind, tmp_path):
    if kind == "samples":
        path = tmp_path / "set"
        io.save(_sample_set(), path, chunk=2)
    else:
        path = _tiny_zoo(tmp_path / "zoo")
    if kind == "dataset":
        path = symlib.zoo.export(path, tmp_path / "exported", validate=False)
    want = _load(path)
    files = sorted(p for p in path.iterdir() if p.is_file())
    originals = {f: f.read_bytes() for f in files}
    rng = random.Random(len(kind))
    errors = 0
    for i in range(FLIPS):
        file = files[i % len(files)]  # every file of the folder, in turn
        pos, mask = _flip(rng, len(originals[file]), anywhere=i % 2 == 1)
        _flipped(file, pos, mask, originals[file])
        try:
            got = _read(path, _load)
        finally:
            file.write_bytes(originals[file])
        if got is None:
            errors += 1
        else:
            assert _same(got, want), f"flip {i}: byte {pos} of {file.name} ^ {mask:#04x} changed the weights"
    assert errors > 0


@pytest.mark.parametrize("key", ["n_samples", "chunk", "chunks"])
def test_a_damaged_key_of_a_sample_set_manifest_is_a_clear_error(key, tmp_path):
    io.save(_sample_set(), tmp_path / "set", chunk=2)
    manifest = tmp_path / "set" / "manifest.json"
    manifest.write_text(manifest.read_text().replace(f'"{key}"', f'"{key[0]}#{key[2:]}"', 1))
    with pytest.raises(symlib.store.StoreError, match=r"manifest\.json"):
        symlib.load(tmp_path / "set")


@pytest.mark.parametrize("flip", [("F32", "I32"), ("F32", "U32")])
def test_a_flipped_dtype_letter_in_a_safetensors_header_is_refused(flip, tmp_path):
    """"F32" -> "I32" makes a valid file whose float weights read as integers: with the network known, the
    tensor's kind (float, integer, ...) must be the network's."""
    from safetensors.torch import save_file

    sd = {k: v.contiguous() for k, v in SmallNet().state_dict().items()}
    save_file(sd, tmp_path / "net.safetensors")
    file = tmp_path / "net.safetensors"
    file.write_bytes(file.read_bytes().replace(f'"{flip[0]}"'.encode(), f'"{flip[1]}"'.encode(), 1))
    with pytest.raises(symlib.errors.CheckpointError, match=r"holds u?int32 values, but .* float values"):
        symlib.load_checkpoints(tmp_path / "net.safetensors", model=SmallNet())
