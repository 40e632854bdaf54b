"""The gentle example: data, the vectorised trainer against the reference loop, chapter parameters."""

import numpy as np
import pytest
import torch

from symlib import scales
from symlib.paper import toy


@pytest.fixture(scope="module")
def data():
    return toy.two_gaussians(n_per_class=200, seed=0)


def test_data_is_two_separable_gaussians(data):
    x, y = data.x.numpy(), data.y.numpy()
    assert x.shape == (400, 2) and (y == 0).sum() == 200 and (y == 1).sum() == 200
    assert toy.is_linearly_separable(x, y)
    for c, mean in enumerate(data.means):
        # class means within 4 standard errors of the drawing means (identity covariance)
        assert np.abs(x[y == c].mean(0) - mean).max() < 4 / np.sqrt(200)
    # same seed, same data
    assert torch.equal(toy.two_gaussians(seed=0).x, data.x)


def test_separability_check_detects_overlap():
    x = np.array([[0.0, 0.0], [1.0, 1.0], [0.5, 0.5], [2.0, 2.0]])
    assert not toy.is_linearly_separable(x, np.array([0, 1, 1, 0]))
    assert toy.is_linearly_separable(x, np.array([0, 1, 0, 1]))
    with pytest.raises(ValueError, match="move the means"):
        toy.two_gaussians(means=((0.0, 0.0), (0.0, 0.0)), max_draws=3)


def test_overlapping_classes_keep_the_first_draw():
    """separable=False: one draw, kept even when no line separates the classes."""
    d = toy.two_gaussians(means=((-0.5, -0.5), (0.5, 0.5)), seed=0, separable=False)
    assert d.draws == 1 and not toy.is_linearly_separable(d.x.numpy(), d.y.numpy())
    sep = toy.two_gaussians(seed=0)
    if sep.draws == 1:  # the same stream: the first draw is the same points around other means
        torch.testing.assert_close(d.x - d.y[:, None] + 0.5, sep.x - 4 * sep.y[:, None] + 2.0)


@pytest.mark.parametrize("activation", ["relu", "tanh"])
@pytest.mark.parametrize("widths,epochs,lr", [((2, 2, 1), 10, 2.0), ((2, 5, 3, 1), 3, 0.5)])
def test_vectorised_training_equals_reference_loop(data, widths, epochs, lr, activation):
    """Same initialisation and batch order: the stacked trainer and torch.optim.SGD agree (ReLU and tanh)."""
    gen = torch.Generator().manual_seed(7)
    n = 3
    init = toy.init_mlps(widths, n, gen)
    orders = toy.batch_orders(n, len(data.x), epochs, gen)
    before = {k: v.clone() for k, v in init.items()}
    fast = toy.train_mlps(data, n, widths=widths, epochs=epochs, lr=lr, init=init, orders=orders,
                          progress=False, activation=activation)
    for k in init:
        assert torch.equal(init[k], before[k]), "the trainer must not modify its inputs"
    for m in range(n):
        ref, loss = toy.train_mlp_loop(data, widths=widths, epochs=epochs, lr=lr, activation=activation,
                                       init={k: v[m] for k, v in init.items()}, order=orders[:, m])
        for k in ref:
            torch.testing.assert_close(fast.theta[k][m], ref[k], rtol=1e-4, atol=1e-4)
        assert fast.losses[m].item() == pytest.approx(loss, rel=1e-3, abs=1e-6)


def test_chunks_and_models_are_independent(data):
    """Training in chunks gives the same models; each model has its own init and order."""
    a = toy.train_mlps(data, 6, epochs=2, seed=3, progress=False)
    b = toy.train_mlps(data, 6, epochs=2, seed=3, chunk=4, progress=False)
    for k in a.theta:
        torch.testing.assert_close(a.theta[k], b.theta[k])
    w = a.theta["0.weight"]
    assert len({tuple(w[i].flatten().tolist()) for i in range(6)}) == 6


def test_most_paper_runs_reach_low_loss(data):
    res = toy.train_mlps(data, 300, seed=1, progress=False)
    assert (res.losses <= 0.01).float().mean() > 0.95  # the paper drops fewer than 1%
    assert torch.isfinite(res.losses).all()


def test_density_summary_on_known_shapes():
    rng = np.random.default_rng(0)
    one_mode = rng.normal([-2.0, 2.0], 0.3, size=(4000, 2))
    mirrored = np.concatenate([one_mode, one_mode[:, ::-1]])
    s1, s2 = toy.density_summary(one_mode), toy.density_summary(mirrored)
    assert s1.mirror_ratio < 1e-3 and s1.above_diagonal == 0.0
    assert s2.mirror_ratio > 0.8 and s2.above_diagonal == pytest.approx(0.5)
    assert abs(s1.peak[0] + 2) < 0.3 and abs(s1.peak[1] - 2) < 0.3
    # sign flips: one mode has no flipped twin; its four reflections (an odd activation's group) do
    flipped = np.concatenate([mirrored * [sx, sy] for sx in (1, -1) for sy in (1, -1)])
    assert s1.flip_ratio < 1e-3 and s2.flip_ratio < 1e-3
    assert toy.density_summary(flipped).flip_ratio > 0.8


def test_tanh_networks_train_and_unknown_activations_are_refused(data):
    res = toy.train_mlps(data, 50, seed=1, progress=False, activation="tanh")
    assert (res.losses <= 0.05).float().mean() > 0.9  # the separable problem is easy for tanh too
    torch.testing.assert_close(toy.mean_losses(res.theta, data.x, data.y, activation="tanh"), res.losses)
    with pytest.raises(ValueError, match="activation"):
        toy.train_mlps(data, 2, progress=False, activation="gelu")


def test_training_rejects_bad_shapes(data):
    with pytest.raises(ValueError, match="one output unit"):
        toy.train_mlps(data, 2, widths=(2, 2, 3))
    with pytest.raises(ValueError, match="features"):
        toy.train_mlps(data, 2, widths=(3, 2, 1))


@pytest.mark.parametrize("bad,err", [("huge", ValueError), (3, TypeError), (None, TypeError)])
def test_chapter_parameters_are_validated(bad, err):
    with pytest.raises(err, match="scale"):
        scales.check_scale(bad)
    assert scales.pick("cpu", tiny=1, cpu=2, paper=3) == 2
    with pytest.raises(TypeError, match="seed must be an integer"):
        scales.check_int("seed", "0")
    with pytest.raises(TypeError, match="device"):
        scales.check_device(0.5)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            scales.check_device("cuda")


def test_book_glue_values_are_plain_numbers():
    from symlib.paper.book import plain

    assert type(plain(np.float64(1.5))) is float and plain(np.float64(1.5)) == 1.5
    assert type(plain(torch.tensor(3))) is int
    assert type(plain(np.int64(7))) is int
    arr = np.arange(3)
    assert plain(arr) is arr and plain("text") == "text"
