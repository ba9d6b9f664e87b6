"""Random ops under plait: the draws eager makes, or at least their distribution
(NOTE [random draws] in tracer/randomness.py).

Three kinds of check. After the same seed, a jitted call draws eager's numbers where plait
calls the op eager calls (and leaves torch's generator where eager leaves it). Over many
seeds, plait's samples and eager's (drawn under other seeds) agree in each element's mean and
variance, within a multiple of the standard error of their difference; where the mean is
known (dropout keeps it), plait's matches it too. Derivatives see the forward's mask.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import plait

# Standard errors a statistic may stray: per element, two-sided, about 6e-7, so a test of a
# few thousand statistics fails by chance about once in a few hundred runs (the seeds are
# fixed, so a passing test always passes); a wrong scale, probability or shared mask moves
# the statistics by tens of standard errors.
Z = 5.0


def _samples(fn, args, seeds) -> torch.Tensor:
    """fn(*args) after torch.manual_seed(s), for each seed s, stacked (float64)."""
    outs = []
    for s in seeds:
        torch.manual_seed(s)
        outs.append(fn(*args).detach().double())
    return torch.stack(outs)


def _variance_se2(x: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """The squared standard error of a sample variance: (fourth central moment - var²) / n."""
    return ((x - x.mean(0)) ** 4).mean(0).sub(var ** 2).clamp(min=0) / len(x)


def assert_same_distribution(got: torch.Tensor, want: torch.Tensor, z: float = Z):
    """Samples [n, ...] of two draws agree in each element's mean and variance."""
    mean_g, mean_w, var_g, var_w = got.mean(0), want.mean(0), got.var(0), want.var(0)
    slack = 1e-6 * (1 + mean_w.abs())  # elements that do not vary: rounding only
    se = (var_g / len(got) + var_w / len(want)).sqrt()
    off = (mean_g - mean_w).abs() - z * se - slack
    assert (off <= 0).all(), f"means differ by {(mean_g - mean_w).abs().max():.4g} " \
        f"(worst {off.max():.4g} past {z} standard errors)"
    # the sample variance strays by its standard error, and by the square of the mean's
    # (var = E[x²] - mean², a term first-order error misses: a coin's variance near 1/4)
    se2 = _variance_se2(got, var_g) + _variance_se2(want, var_w)
    off = (var_g - var_w).abs() - z * se2.sqrt() - z ** 2 * (var_g / len(got) + var_w / len(
        want)) - slack * (1 + var_w)
    assert (off <= 0).all(), f"variances differ by {(var_g - var_w).abs().max():.4g} " \
        f"(worst {off.max():.4g} past {z} standard errors)"


def assert_mean(got: torch.Tensor, expected: torch.Tensor, z: float = Z):
    """Each element's sample mean is within z standard errors of ``expected``."""
    se = (got.var(0) / len(got)).sqrt()
    off = (got.mean(0) - expected.double()).abs() - z * se - 1e-6 * (1 + expected.abs())
    assert (off <= 0).all(), f"mean off by {(got.mean(0) - expected).abs().max():.4g}"


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# -- every random path, as (function, inputs) ---------------------------------------------
# A function returns floats whose mean and variance describe the draw: integer draws as
# one-hot counts or values, Cauchy draws through atan (uniform), log-normal ones through log.
_X = _randn(4, 6)
_QKV = tuple(_randn(2, 2, 5, 4, seed=s) for s in (1, 2, 3))
_BOOL_MASK = torch.rand(5, 5, generator=torch.Generator().manual_seed(4)) > 0.3
_BOOL_MASK[:, 0] = True  # no row masked whole
_ADDITIVE_MASK = _randn(5, 5, seed=5)
_PROBS = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.0], [0.5, 0.25, 0.125, 0.0625, 0.0625]])


_MHA = torch.nn.MultiheadAttention(4, 2, dropout=0.3)
_ENCODER_LAYER = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.3)


CASES = {
    "dropout": (lambda x: F.dropout(x, 0.3), (_X,)),
    "dropout_in_place": (lambda x: F.dropout(x * 1, 0.3, inplace=True), (_X,)),
    "dropout1d": (lambda x: F.dropout1d(x, 0.3), (_randn(3, 4, 5),)),
    "dropout2d": (lambda x: F.dropout2d(x, 0.3), (_randn(2, 4, 3, 3),)),
    "dropout3d": (lambda x: F.dropout3d(x, 0.3), (_randn(2, 3, 2, 2, 2),)),
    "alpha_dropout": (lambda x: F.alpha_dropout(x, 0.3, True), (_X,)),
    "feature_alpha_dropout": (lambda x: F.feature_alpha_dropout(x, 0.3, True),
                              (_randn(2, 4, 3, 3),)),
    "sdpa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.3), _QKV),
    "sdpa_causal": (lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, dropout_p=0.3, is_causal=True), _QKV),
    "sdpa_bool_mask": (lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, _BOOL_MASK, dropout_p=0.3), _QKV),
    "sdpa_additive_mask": (lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, _ADDITIVE_MASK, dropout_p=0.3), _QKV),
    "multi_head_attention": (lambda x: _MHA(x, x, x, need_weights=False)[0],
                             (_randn(5, 2, 4),)),
    "multi_head_attention_weights": (lambda x: _MHA(x, x, x)[0], (_randn(5, 2, 4),)),
    "transformer_encoder_layer": (_ENCODER_LAYER, (_randn(5, 2, 4),)),
    "rrelu": (lambda x: F.rrelu(x, 0.1, 0.4, training=True), (_X,)),
    "rrelu_in_place": (lambda x: F.rrelu(x * 1, 0.1, 0.4, training=True, inplace=True), (_X,)),
    "fractional_max_pool2d": (lambda x: F.fractional_max_pool2d(x, 2, output_size=(3, 4)),
                              (_randn(2, 2, 7, 9),)),
    "fractional_max_pool3d": (lambda x: F.fractional_max_pool3d(x, 2, output_size=(2, 3, 2)),
                              (_randn(2, 3, 5, 5, 5),)),
    "bernoulli": (lambda p: torch.bernoulli(p), (torch.rand(4, 6, generator=torch.Generator()
                                                            .manual_seed(6)),)),
    "bernoulli_float_p": (lambda x: torch.bernoulli(x, 0.3), (_X,)),
    "bernoulli_": (lambda x: x.clone().bernoulli_(0.3), (_X,)),
    "rand": (lambda x: x + torch.rand(4, 6), (torch.zeros(4, 6),)),
    "randn": (lambda x: x + torch.randn(4, 6), (torch.zeros(4, 6),)),
    "randint": (lambda x: x + torch.randint(2, 9, (4, 6)), (torch.zeros(4, 6),)),
    "rand_like": (lambda x: torch.rand_like(x), (_X,)),
    "randn_like": (lambda x: torch.randn_like(x), (_X,)),
    "randint_like": (lambda x: torch.randint_like(x, 3, 11), (_X,)),
    "normal_tensor_tensor": (lambda m, s: torch.normal(m, s), (_X, _X.abs() + 0.5)),
    "normal_tensor_float": (lambda m: torch.normal(m, 2.0), (_X,)),
    "normal_float_tensor": (lambda s: torch.normal(1.0, s), (_X.abs() + 0.5,)),
    "normal_float_float": (lambda x: x + torch.normal(1.0, 2.0, (4, 6)), (torch.zeros(4, 6),)),
    "multinomial": (lambda p: F.one_hot(torch.multinomial(p, 3), 5).double(), (_PROBS,)),
    "multinomial_replacement": (lambda p: F.one_hot(
        torch.multinomial(p, 6, replacement=True), 5).double(), (_PROBS,)),
    "randperm": (lambda x: x + torch.randperm(7), (torch.zeros(7),)),
    "uniform_": (lambda x: x.clone().uniform_(-1, 3), (_X,)),
    "normal_": (lambda x: x.clone().normal_(1, 2), (_X,)),
    "random_": (lambda x: x.clone().random_(2, 9), (_X,)),
    "exponential_": (lambda x: x.clone().exponential_(2.0), (_X,)),
    "cauchy_": (lambda x: x.clone().cauchy_(1.0, 2.0).sub(1).div(2).atan(), (_X,)),
    "geometric_": (lambda x: x.clone().geometric_(0.3), (_X,)),
    "log_normal_": (lambda x: x.clone().log_normal_(1.0, 0.5).log(), (_X,)),
    "poisson": (lambda r: torch.poisson(r), (_X.abs() * 3,)),
}
# Where torch's decomposition draws otherwise than eager's kernel (exponential_, cauchy_ and
# geometric_ from uniform draws), or eager's kernel draws a count of numbers that depends on
# the data (rrelu), plait promises the distribution only.
DISTRIBUTION_ONLY = {"exponential_", "cauchy_", "geometric_", "log_normal_", "rrelu", "rrelu_in_place"}


def _cloned(args):
    return tuple(a.clone() for a in args)


@pytest.mark.parametrize("name", sorted(set(CASES) - DISTRIBUTION_ONLY))
def test_same_seed_draws_eagers_numbers(name):
    """After the same seed, the jitted call gives eager's result (to rounding: plait's
    products sum in another order) and leaves torch's generator where eager leaves it; another
    seed gives another result."""
    fn, args = CASES[name]
    jitted = plait.jit(fn)
    results = []
    for run in (jitted, fn):
        torch.manual_seed(7)
        results.append((run(*_cloned(args)).detach(), torch.rand(3)))
    (got, after), (want, after_eager) = results
    assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert torch.equal(after, after_eager), "the generator advanced otherwise than eager's"
    torch.manual_seed(8)
    assert not torch.equal(jitted(*_cloned(args)).detach(), got)


@pytest.mark.parametrize("name", sorted(DISTRIBUTION_ONLY))
def test_ops_that_draw_otherwise_still_draw_anew(name):
    """Not eager's numbers (see DISTRIBUTION_ONLY), but a fresh draw per call and per seed,
    and the same one for the same seed."""
    fn, args = CASES[name]
    jitted = plait.jit(fn)
    torch.manual_seed(7)
    first, second = jitted(*_cloned(args)), jitted(*_cloned(args))
    torch.manual_seed(7)
    assert torch.equal(jitted(*_cloned(args)), first)
    assert not torch.equal(first, second)


def _distribution_case(name, seeds):
    fn, args = CASES[name]
    got = _samples(plait.jit(fn), _cloned(args), range(seeds))
    want = _samples(fn, _cloned(args), range(seeds, 2 * seeds))  # independent of plait's
    assert_same_distribution(got, want)
    return got, args


@pytest.mark.parametrize("name", sorted(CASES))
def test_distribution_matches_eager(name):
    """Each element's mean and variance over 60 seeds, against eager's over 60 others."""
    _distribution_case(name, 60)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_distribution_matches_eager_over_many_seeds(name):
    """The same over 2000 seeds each: differences a sixth of the fast test's show."""
    _distribution_case(name, 2000)


# -- known means: dropout keeps the expectation --------------------------------------------
_DROPOUT_FREE = {
    "dropout": lambda x: x, "dropout_in_place": lambda x: x, "dropout1d": lambda x: x,
    "dropout2d": lambda x: x, "dropout3d": lambda x: x,
    "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
    "sdpa_causal": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    "sdpa_bool_mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, _BOOL_MASK),
    "sdpa_additive_mask": lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, _ADDITIVE_MASK),
}


@pytest.mark.parametrize("name", sorted(_DROPOUT_FREE))
def test_dropout_keeps_the_mean_and_scales_by_the_keep_probability(name):
    """Inverted dropout: E[out] is the dropout-free result, and each draw is either 0 or that
    result / (1 - p) (elementwise dropout), so a swapped keep/drop probability, a wrong scale
    or a mask shared across positions shows. Over 150 seeds."""
    fn, args = CASES[name]
    got = _samples(plait.jit(fn), _cloned(args), range(150))
    expected = _DROPOUT_FREE[name](*args).double()
    assert_mean(got, expected)
    if name.startswith("sdpa"):
        return
    kept = got != 0
    assert_close(got[kept], (expected / 0.7).expand_as(got)[kept])
    assert_mean(kept.double(), torch.full_like(expected, 0.7))  # the keep probability


@pytest.mark.parametrize("name", ["dropout1d", "dropout2d", "dropout3d"])
def test_feature_dropout_drops_whole_channels(name):
    """One draw per (example, channel), shared by its positions; channels independent."""
    fn, (x,) = CASES[name]
    got = _samples(plait.jit(fn), (x,), range(200))
    kept = (got != 0).flatten(3)  # [seed, example, channel, position]
    assert (kept == kept[..., :1]).all()
    assert not torch.equal(kept[:, 0, 0, 0], kept[:, 0, 1, 0])
    assert not torch.equal(kept[:, 0, 0, 0], kept[:, 1, 0, 0])


@pytest.mark.parametrize("need_weights", [False, True])
def test_multi_head_attention_in_training_keeps_the_eval_mean(need_weights):
    """multi_head_attention_forward(training=True) drops attention weights only, so its mean
    is the eval output (need_weights=False goes through scaled_dot_product_attention)."""
    fn, args = CASES["multi_head_attention" + ("_weights" if need_weights else "")]
    got = _samples(plait.jit(fn), args, range(150))
    _MHA.eval()
    try:
        expected = fn(*args).detach()
    finally:
        _MHA.train()
    assert_mean(got, expected)


def test_rrelu_slopes_are_uniform_in_their_bounds():
    """Non-positive elements times a slope uniform in [lower, upper]: mean (l + u) / 2,
    variance (u - l)² / 12; positive ones pass."""
    fn, (x,) = CASES["rrelu"]
    got = _samples(plait.jit(fn), (x,), range(150))
    negative = x < 0
    slopes = (got / x.double())[:, negative]
    assert slopes.min() >= 0.1 and slopes.max() <= 0.4
    assert_mean(slopes, torch.full(slopes.shape[1:], 0.25))
    assert abs(slopes.var() - 0.3 ** 2 / 12) < Z * math.sqrt(_variance_se2(
        slopes.flatten(), slopes.var()).item())
    assert (got[:, ~negative] == x[~negative]).all()


# -- derivatives see the forward's mask ----------------------------------------------------
@pytest.mark.parametrize("name", ["dropout", "dropout2d", "alpha_dropout", "rrelu"])
def test_the_gradient_uses_the_forwards_mask(name):
    """vjp's forward and backward of one call: d out / d x is out / x where out is x times
    the mask (dropout, rrelu), or the mask's scale where alpha dropout keeps x."""
    fn, (x,) = CASES[name]
    torch.manual_seed(3)
    out, pullback = plait.vjp(fn, x)
    (grad,) = pullback(torch.ones_like(out))
    if name != "alpha_dropout":
        assert_close(grad, out / x)
        return
    # alpha dropout: out = a * mask * x + c(mask), so grad = a * mask, and out - grad * x is
    # one constant where the gradient's mask keeps, another where it drops
    kept = grad != 0
    assert 0 < kept.sum() < kept.numel() and len(grad[kept].unique()) == 1
    rest = out - grad * x
    for part in (rest[kept], rest[~kept]):
        assert_close(part, part[:1].expand_as(part))


@pytest.mark.parametrize("name", ["dropout", "dropout3d", "sdpa", "sdpa_causal",
                                  "sdpa_bool_mask", "sdpa_additive_mask",
                                  "multi_head_attention", "fractional_max_pool2d",
                                  "fractional_max_pool3d"])
def test_gradients_match_autograd_under_the_same_seed(name):
    """loss.backward() through the jitted function, and plait.grad, give torch.autograd's
    gradients under the same seed (the same mask)."""
    fn, args = CASES[name]
    weights = torch.randn_like(fn(*args))
    results = []
    for run in (plait.jit(fn), fn):
        leaves = [a.clone().requires_grad_() for a in args]
        torch.manual_seed(11)
        (run(*leaves) * weights).sum().backward()
        results.append([leaf.grad for leaf in leaves])
    torch.manual_seed(11)
    grads = plait.grad(lambda *a: (fn(*a) * weights).sum(), argnums=tuple(range(len(args))))(
        *_cloned(args))
    assert_close(results[0], results[1], atol=1e-5, rtol=1e-5)
    assert_close(list(grads), results[1], atol=1e-5, rtol=1e-5)


def test_noise_drawn_like_a_differentiated_value_is_not_differentiated():
    """The reparameterization trick: mu + randn_like(std) * std differentiates in mu and std
    (the draw itself has no derivative, as in torch)."""
    mu, log_var = _randn(5), _randn(5, seed=1)
    loss = lambda m, lv: (m + torch.randn_like(lv) * (0.5 * lv).exp()).square().sum()  # noqa
    leaves = [mu.clone().requires_grad_(), log_var.clone().requires_grad_()]
    torch.manual_seed(2)
    want = torch.autograd.grad(loss(*leaves), leaves)
    torch.manual_seed(2)
    assert_close(plait.grad(loss, argnums=(0, 1))(mu, log_var), want)


# -- vmap's randomness ---------------------------------------------------------------------
@pytest.mark.parametrize("randomness", ["same", "different"])
@pytest.mark.parametrize("name", ["dropout", "rand_like"])
def test_vmap_randomness_follows_torch_func(name, randomness):
    fn, (x,) = CASES[name]
    batch = x.expand(3, *x.shape).clone()
    results = []
    for vmap in (plait.vmap, torch.func.vmap):
        torch.manual_seed(5)
        results.append(vmap(fn, randomness=randomness)(batch))
    assert_close(*results)
    assert torch.equal(results[0][0], results[0][1]) == (randomness == "same")


# -- the compiled backend draws in program order ---------------------------------------------
def test_cpp_backend_draws_eagers_numbers():
    def f(x, q, k, v, p):
        return (F.dropout(x, 0.3).sum() + torch.rand_like(x).sum()
                + F.scaled_dot_product_attention(q, k, v, dropout_p=0.3).sum()
                + torch.multinomial(p, 3).sum())

    args = (_X, *_QKV, _PROBS)
    torch.manual_seed(4)
    got = plait.jit(f, backend="cpp")(*args)
    torch.manual_seed(4)
    assert_close(got, f(*args))


# -- seeding in a traced function -----------------------------------------------------------
@pytest.mark.parametrize("seeding", [
    lambda: torch.manual_seed(42), lambda: torch.random.manual_seed(42), lambda: torch.seed(),
    lambda: torch.set_rng_state(torch.get_rng_state()), lambda: torch.cuda.manual_seed(42)])
def test_a_draw_after_seeding_inside_a_traced_function_is_refused(seeding):
    """The seeding would run once, while tracing, not at each call; the draws after it would
    not follow it. Outside a trace the functions are torch's."""
    def f(x):
        seeding()
        return F.dropout(x, 0.5)

    with pytest.raises(plait.errors.TraceError, match=r"\.(manual_seed|seed|set_rng_state)\(\)"):
        plait.jit(f)(_X)
    torch.manual_seed(3)
    assert torch.initial_seed() == 3


def test_seeding_around_code_that_draws_nothing_is_harmless():
    """OpInfo runs its random ops' samples under a wrapper that seeds 42 and restores the
    state after: where the sample draws nothing it traces; where it draws, it is refused."""
    from torch.testing._utils import wrapper_set_seed
    x = _randn(2, 3, 5, 5, 5)
    eval_dropout = plait.jit(lambda x: wrapper_set_seed(F.dropout, x, 0.5, training=False))
    assert_close(eval_dropout(x), x)
    with pytest.raises(plait.errors.TraceError, match="manual_seed"):
        plait.jit(lambda x: wrapper_set_seed(F.fractional_max_pool3d, x, 2,
                                             output_size=(2, 3, 2)))(x)


def test_fractional_max_pool_with_given_samples_is_eagers():
    """Non-cubic windows and output sizes, the samples passed in (no draw) or drawn."""
    x = _randn(2, 3, 5, 6, 7)
    samples = torch.rand(2, 3, 3, generator=torch.Generator().manual_seed(1))
    for kernel, size in [((2, 1, 3), (3, 3, 2)), ((1, 3, 2), (4, 2, 5)), (2, (2, 3, 2))]:
        def pool(x, s):
            return F.fractional_max_pool3d(x, kernel, output_size=size, _random_samples=s,
                                           return_indices=True)

        assert_close(plait.jit(pool)(x, samples), pool(x, samples))
