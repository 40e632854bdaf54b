"""The adapters against the real libraries: laplace-torch's samples, posteriors' sample trees,
torch-uncertainty's deep and packed ensembles (unpacked exactly, or refused with the reason)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from ckpt_nets import INPUT_SHAPE, SmallNet
from torch import nn

import symlib
from symlib.ckpt import CheckpointError

N = 32


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, *INPUT_SHAPE, generator=g), torch.randint(0, 3, (N,), generator=g)


@pytest.fixture(scope="module")
def net(data):
    torch.manual_seed(0)
    model = SmallNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data
    for _ in range(5):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model.eval()


def _flat(theta, names, n):
    return torch.cat([theta[k].reshape(n, -1) for k in names], 1)


def test_laplace_torch_samples_are_whole_networks(net, data):
    laplace = pytest.importorskip("laplace")
    from symlib.ckpt import from_laplace

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data), batch_size=16)
    model = copy.deepcopy(net)
    la = laplace.Laplace(model, "classification", subset_of_weights="all", hessian_structure="diag")
    la.fit(loader)
    theta = from_laplace.samples(la, 7, generator=torch.Generator().manual_seed(1))
    draws = la.sample(7, generator=torch.Generator().manual_seed(1))
    names = [n for n, _ in model.named_parameters()]
    assert torch.equal(_flat(theta, names, 7), draws.to(theta[names[0]].dtype))  # the same vectors, by name
    assert set(theta) == set(model.state_dict())
    for k in ("bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"):  # buffers: the MAP
        assert all(torch.equal(theta[k][i], model.state_dict()[k]) for i in range(7))
    # a last-layer Laplace samples the head only; every other tensor stays at the MAP
    model2 = copy.deepcopy(net)
    ll = laplace.Laplace(model2, "classification", subset_of_weights="last_layer", hessian_structure="kron")
    ll.fit(loader)
    head = from_laplace.samples(ll, 5, generator=torch.Generator().manual_seed(2))
    draws2 = ll.sample(5, generator=torch.Generator().manual_seed(2))
    assert torch.equal(_flat(head, ["head.weight", "head.bias"], 5), draws2.to(head["head.bias"].dtype))
    for k, v in net.state_dict().items():
        if not k.startswith("head."):
            assert all(torch.equal(head[k][i], v) for i in range(5)), k
    inner = from_laplace.network(ll)  # laplace's FeatureExtractor keeps the network
    assert isinstance(inner, SmallNet) and all(torch.equal(inner.state_dict()[k], v)
                                               for k, v in model2.state_dict().items())
    # "how far is my Laplace from my other Laplace, symmetries removed?" in three lines
    spec = symlib.spec_of(from_laplace.network(la), INPUT_SHAPE)
    res = symlib.mmd(theta, head, spec=spec, symmetries="ns")
    assert float(res.value()) > 0
    with pytest.raises(CheckpointError, match="fit the approximation first"):
        from_laplace.samples(laplace.Laplace(copy.deepcopy(net), "classification", subset_of_weights="all",
                                             hessian_structure="diag"), 3)


def test_posteriors_sample_trees(net, data):
    posteriors = pytest.importorskip("posteriors")
    import optree
    import torchopt

    from symlib.ckpt import from_posteriors

    x, y = data
    params = {k: v.detach().clone() for k, v in net.named_parameters()}

    def log_posterior(p, batch):
        out = torch.func.functional_call(net, p, (batch[0],))
        return -F.cross_entropy(out, batch[1]), out

    transform = posteriors.vi.diag.build(log_posterior, torchopt.adam(lr=1e-2), temperature=1 / N)
    state = transform.init(params)
    chain = []
    for _ in range(3):
        state, _ = transform.update(state, (x, y))
        chain.append(state.params)
    draws = posteriors.vi.diag.sample(state, (6,))
    theta = from_posteriors.samples(draws, net)
    assert set(theta) == set(net.state_dict())
    for k, v in draws.items():
        assert torch.equal(theta[k], v)
    assert all(torch.equal(theta["bn1.running_var"][i], net.bn1.running_var) for i in range(6))
    stacked = optree.tree_map(lambda *leaves: torch.stack(leaves), *chain)  # a chain's states, stacked
    means = from_posteriors.samples(stacked, net)
    assert all(torch.equal(means[k][i], chain[i][k]) for k in params for i in range(3))
    nested = {"body": {"w": torch.zeros(4, 2, 3)}, "head": [torch.ones(4, 5)]}
    assert {k: tuple(v.shape) for k, v in from_posteriors.samples(nested).items()} == {
        "body.w": (4, 2, 3), "head.0": (4, 5)}
    with pytest.raises(CheckpointError, match=r"'conv9\.weight' is not in SmallNet"):
        from_posteriors.samples({**draws, "conv9.weight": torch.zeros(6, 2)}, net)
    with pytest.raises(CheckpointError, match="the same leading axis of samples"):
        from_posteriors.samples({**draws, "head.bias": torch.zeros(5, 3)}, net)


def test_torch_uncertainty_deep_ensembles(tmp_path):
    pytest.importorskip("torch_uncertainty")
    from torch_uncertainty.methods import deep_ensembles
    from torch_uncertainty.models.classification import lenet

    from symlib.ckpt import from_torch_uncertainty as tu

    torch.manual_seed(0)
    ens = deep_ensembles(lenet(in_channels=1, num_classes=10), num_estimators=3)
    theta = tu.members(ens)
    for i, m in enumerate(ens.core_models):
        assert all(torch.equal(theta[k][i], v) for k, v in m.state_dict().items())
    assert type(tu.member(ens)) is type(ens.core_models[0])
    odd = deep_ensembles([lenet(in_channels=1, num_classes=10), lenet(in_channels=1, num_classes=4)])
    with pytest.raises(CheckpointError, match=r"member 1 differs from member 0 at tensor "
                                              r"'fc3\.(weight|bias)'"):
        tu.members(odd)


class _PackedBN(nn.Module):
    """A packed network with BatchNorm over its members' channels (torch-uncertainty's layers)."""

    def __init__(self, m: int = 2):
        super().__init__()
        from torch_uncertainty.layers import PackedConv2d, PackedLinear

        self.conv1 = PackedConv2d(1, 4, 3, alpha=2, num_estimators=m, padding=1, first=True)
        self.bn1 = nn.BatchNorm2d(4 * 2)
        self.conv2 = PackedConv2d(4, 6, 3, alpha=2, num_estimators=m, stride=2, padding=1)
        self.head = PackedLinear(6, 5, alpha=2, num_estimators=m, last=True)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.conv2(x))
        return self.head(x.mean((2, 3)))


def test_torch_uncertainty_packed_ensembles_unpack_exactly_or_are_refused():
    pytest.importorskip("torch_uncertainty")
    from torch_uncertainty.models.classification import packed_lenet

    from symlib.ckpt import from_torch_uncertainty as tu

    torch.manual_seed(0)
    packed = packed_lenet(in_channels=1, num_classes=10, num_estimators=4, alpha=2).eval()
    theta = tu.members(packed, input_shape=(1, 28, 28))
    assert theta["conv2.weight"].shape == (4, 8, 3, 5, 5) and theta["fc3.weight"].shape == (4, 10, 42)
    # checked here again, independently: member m of the unpacked set computes the packed network's output m
    x = torch.randn(5, 1, 28, 28)
    member = tu.member(packed)
    with torch.no_grad():
        want = packed(x).reshape(4, 5, 10)
        for m in range(4):
            member.load_state_dict(symlib.params.unstack(theta, m))
            assert torch.allclose(member(x), want[m], atol=1e-5, rtol=1e-5)
    spec = symlib.spec_of(member, (1, 28, 28))
    assert symlib.count(spec).iloc[-1]["log10_permutations"] > 0
    # BatchNorm over the members' channels unpacks too
    torch.manual_seed(1)
    bn = _PackedBN().train()
    bn(torch.randn(16, 1, 8, 8))  # running statistics move
    bn.eval()
    theta_bn = tu.members(bn, input_shape=(1, 8, 8))
    assert theta_bn["bn1.running_mean"].shape == (2, 4) and torch.equal(
        theta_bn["bn1.running_mean"].reshape(-1), bn.bn1.running_mean)
    # members that are themselves grouped linear layers (gamma > 1) have no plain layer: refused
    grouped = packed_lenet(in_channels=1, num_classes=10, num_estimators=2, alpha=2, gamma=2)
    with pytest.raises(CheckpointError, match=r"cannot be unpacked exactly: a PackedLinear of 4 groups for 2 "
                                              r"estimators \(gamma > 1"):
        tu.members(grouped, input_shape=(1, 28, 28))

    class Mixed(_PackedBN):
        def forward(self, x):  # mixes the members: the output of member m depends on the others
            out = super().forward(x)
            return out + out.roll(x.shape[0], 0)

    with pytest.raises(CheckpointError, match=r"member 0 does not reproduce the packed network's output 0"):
        tu.members(Mixed().eval(), input_shape=(1, 8, 8))
    with pytest.raises(CheckpointError, match="pass input_shape="):
        tu.members(packed)
