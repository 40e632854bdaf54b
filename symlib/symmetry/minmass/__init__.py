r"""The min-mass problem: the lightest member of a network's scaling orbit (book: chapter "Min-mass";
paper §3.6, Def. 3.3, Prop. 2, App. C.7).

The *mass* of a network is its L2-regularisation term without the biases. A
positive rescaling ``lam`` of the hidden neurons leaves the function unchanged
but changes the mass; with ``u = log lam`` and ``Q = W**2`` summed over every axis
no scaling acts on (a convolution's kernel positions, for instance),

.. math:: M(u) = \sum_{W} \sum_{i,j} Q_W[i,j]\, e^{2 u_{\mathrm{out}(W),i} - 2 u_{\mathrm{in}(W),j}},

with ``u = 0`` on the input and output layers. ``M`` is a sum of exponentials of
linear functions of ``u``: convex, and strictly convex and coercive when no
neuron is degenerate, so it has a unique minimiser ``u*`` (paper Prop. 2). The
optimality condition reads, for every hidden neuron ``i``,

.. math:: \lambda_i^2 A_i = \lambda_i^{-2} B_i \iff \lambda_i^4 = B_i / A_i,

where ``A_i`` is the mass of the neuron's incoming weights and ``B_i`` that of its
outgoing weights, the other neurons held fixed: at the optimum every neuron's
incoming and outgoing masses are equal ("balanced").

Solver (:func:`solve`). A few Gauss-Seidel sweeps over the scaling labels, each
the closed-form update above for a whole layer at once, bring ``u`` near the
optimum; damped Newton steps in log space (dense Hessian, Cholesky, backtracking
line search) then converge quadratically. Networks with more than 8,192 scales
(ResNet-50: 11,456), where a dense Cholesky factorisation costs too much, instead
alternate a coarse correction (the best log-shift of every label at once, a small
Newton problem: :mod:`~symlib.symmetry.minmass.coarse`) with a sweep, and
extrapolate these iterates by Anderson acceleration; sweeps alone converge slowly
on deep networks (1,415 sweeps on ResNet-50, against 21 iterations). Everything is
batched over a leading axis of networks and runs in float64. Convergence is
declared when every free neuron is balanced to a relative ``tol``:
``|in_i - out_i| <= tol (in_i + out_i)``.

Degenerate neurons (paper Def. C.7). A neuron whose incoming or outgoing weights
are all zero (a dead ReLU unit), or more generally one that no path of non-zero
weights links to both the input and the output, has a scale direction along
which the mass never grows, so the problem has no minimiser over it. Such
neurons are detected by a reachability pass, their scale is held at 1 and they
are reported; the minimum is then over the remaining neurons, which is a
strictly convex problem with a unique solution.

BatchNorm. In eval mode ``BN(conv(x))`` is invariant to rescaling the conv's
output channels (up to the epsilon in the variance), so the conv's scale only
multiplies incoming mass and the infimum is reached at ``lam -> 0``: no minimiser.
We fold every BatchNorm into the conv before it (:func:`fold_batchnorm`), which
gives a network without BatchNorm that computes the same function, and solve
min-mass on the folded network; its masses are the ones reported. A spec with a
scaling label that has incoming weights but no outgoing ones is refused with a
pointer to :func:`fold_batchnorm`.

The reference (:func:`reference`) is the cvxpy formulation: a geometric program
(``gp=True``, the paper's) for small networks and the log-sum-exp convex form in
``u`` for larger ones.

Layout: :mod:`~symlib.symmetry.minmass.terms` (the mass, its terms, degenerate neurons),
:mod:`~symlib.symmetry.minmass.solver` (sweeps + Newton, :func:`minmass`),
:mod:`~symlib.symmetry.minmass.coarse` (the label-wide coarse problem),
:mod:`~symlib.symmetry.minmass.cvxpy_reference` (cvxpy) and :mod:`~symlib.symmetry.minmass.batchnorm`
(folding); every public name is re-exported here.
"""

from symlib.symmetry.minmass.batchnorm import Folded, fold_batchnorm
from symlib.symmetry.minmass.cvxpy_reference import reference
from symlib.symmetry.minmass.solver import MinMassResult, Solution, minmass, solve
from symlib.symmetry.minmass.terms import Problem, Term, degenerate, mass, neuron_masses, objective, problem
from symlib.symmetry.minmass.terms import _in_out as _in_out  # used by the tests
from symlib.symmetry.spec import Params, Spec, SymmetryError

__all__ = [
    "Folded", "MinMassResult", "Params", "Problem", "Solution", "Spec", "SymmetryError", "Term",
    "degenerate", "fold_batchnorm", "mass", "minmass", "neuron_masses", "objective", "problem",
    "reference", "solve",
]
