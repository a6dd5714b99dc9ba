"""The CPU stand-in of Transformer Engine's fp8 grouped GEMM (``te_grouped_fp8``) against
independent computations of TE's rules: fp8 rounding, scales, E8M0 exponents, scale storage
shapes, which operand each GEMM uses, and one quantizer per group."""

import math

import pytest
import torch

import te_grouped_fp8 as te

GEN = torch.Generator().manual_seed(11)


def fp8_grid(fmt: str) -> torch.Tensor:
    """Every finite value of ``fmt``, ordered by code (sign-magnitude)."""
    values = torch.arange(256, dtype=torch.uint8).view(te.FORMATS[fmt][0]).float()
    return values[torch.isfinite(values)]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_rounding_is_to_the_nearest_grid_value_ties_to_even_and_saturates(fmt):
    grid = fp8_grid(fmt).unique()
    fp8_max = te.FORMATS[fmt][1]
    assert grid.max().item() == fp8_max
    inside = (torch.rand(4000, generator=GEN) * 2 - 1) * fp8_max
    midpoints = (grid[1:] + grid[:-1]) / 2  # ties: round to the code with an even mantissa
    x = torch.cat([inside, midpoints])
    nearest = grid[(x[:, None] - grid[None, :]).abs().argmin(dim=1)]
    rounded = te._cast(x, fmt).float()
    ties = torch.isin(x, midpoints)
    assert torch.equal(rounded[~ties], nearest[~ties])
    assert (te._cast(rounded[ties], fmt).view(torch.uint8) % 2 == 0).all()  # even code
    # TE converts with satfinite: beyond the largest value it saturates (torch alone gives e5m2 inf)
    beyond = torch.tensor([fp8_max * 1.5, -fp8_max * 4, 1e30])
    assert torch.equal(te._cast(beyond, fmt).float(), torch.tensor([fp8_max, -fp8_max, fp8_max]))


def test_scales_follow_compute_scale_from_amax():
    amax = torch.tensor([1.0, 3.0, 1e-3, 0.0, float("inf"), 1e-45])
    fp32 = te.compute_scale_from_amax(amax, 448.0, pow_2=False)
    pow_2 = te.compute_scale_from_amax(amax, 448.0, pow_2=True)
    for a, s, p in zip(amax.tolist(), fp32.tolist(), pow_2.tolist()):
        if a == 0.0 or math.isinf(a):
            assert s == p == 1.0  # TE: scale 1 for an amax of 0, inf or nan
        elif 448.0 / a > torch.finfo(torch.float32).max:
            assert s == torch.finfo(torch.float32).max
        else:
            assert s == pytest.approx(448.0 / a, rel=2**-23)
            assert p == 2.0 ** math.floor(math.log2(448.0 / a))


def test_e8m0_rounds_the_exponent_up():
    values = torch.cat(
        [
            torch.rand(500, generator=GEN) * 10.0 ** torch.randint(-30, 30, (500,), generator=GEN),
            torch.tensor([1.0, 0.5, 2.0**-100, 3.0]),
        ]
    )
    e8m0 = te.float_to_e8m0(values)
    for v, e in zip(values.tolist(), e8m0.tolist()):
        mantissa, exponent = math.frexp(v)  # v = m 2^exponent, 0.5 <= m < 1
        want = exponent - 1 + 127 + (0 if mantissa == 0.5 else 1)  # ceil(log2 v) + bias
        assert e == want, (v, e, want)
    assert te.e8m0_to_scale(torch.tensor([127, 130], dtype=torch.uint8)).tolist() == [1.0, 8.0]


def test_scale_storage_is_shaped_and_padded_as_te():
    """TE's ``get_scale_shape``: MXFP8 [roundup(M, 128), roundup(K / 32, 4)] row-wise and
    [roundup(M / 32, 4), roundup(K, 128)] column-wise; 1-D blocks [ceil(K / 128), roundup(M, 4)]
    row-wise and [ceil(M / 128), roundup(K, 4)] column-wise; 2-D [ceil(M / 128), roundup(ceil(K / 128), 4)]."""
    x = torch.randn(96, 64, generator=GEN)
    assert te.quantize_mxfp8(x, "e4m3", columnwise=False).scale_inv.shape == (128, 4)
    assert te.quantize_mxfp8(x, "e4m3", columnwise=True).scale_inv.shape == (4, 128)
    y = torch.randn(300, 66, generator=GEN)
    assert te.quantize_blockwise(y, "e4m3", columnwise=False).scale_inv.shape == (1, 300)
    assert te.quantize_blockwise(y, "e4m3", columnwise=True).scale_inv.shape == (3, 68)
    w = torch.randn(300, 200, generator=GEN)
    assert te.quantize_blockwise(w, "e4m3", columnwise=False, two_d=True).scale_inv.shape == (3, 4)
    assert te.quantize_blockwise(w, "e4m3", columnwise=True, two_d=True).scale_inv.shape == (2, 4)
    with pytest.raises(ValueError, match="multiple of 32"):
        te.quantize_mxfp8(torch.randn(48, 64), "e4m3", columnwise=False)


@pytest.mark.parametrize("recipe", te.RECIPES)
def test_blocks_scale_independently(recipe):
    """A block's values change only with its own amax: scaling a region by 2^10 rescales the
    blocks it covers (tensorwise: all of them) and no other value."""
    x = torch.randn(128, 256, generator=GEN)
    block = {"tensorwise": (128, 256), "blockwise": (1, 128), "mxfp8": (1, 32)}[recipe]
    quantize = lambda t: te.quantize_activation(t, te.Fp8Recipe(recipe), "e4m3")[0]  # noqa: E731
    base = quantize(x)
    scaled = x.clone()
    scaled[: block[0], : block[1]] *= 1.5
    changed = quantize(scaled) != base
    changed[: block[0], : block[1]] = False
    assert not changed.any()
    if recipe != "tensorwise":
        bigger = x.clone()
        bigger[0, 0] = 1e3
        assert torch.equal(quantize(bigger)[1:], base[1:])  # rows are separate blocks


def manual_grouped_linear(rows, weights, m_splits, recipe, grad):
    """An independent assembly of TE's grouped GEMM from the quantizers: fprop x_row @ w_row.T,
    dgrad dy_row @ w_col, wgrad dy_col.T @ x_col, per group."""
    outs, dxs, dws = [], [], []
    for x, w, dy in zip(torch.split(rows, m_splits), weights, torch.split(grad, m_splits)):
        x_row, x_col = te.quantize_activation(x, recipe, "e4m3")
        w_row, w_col = te.quantize_weight(w, recipe)
        dy_row, dy_col = te.quantize_activation(dy, recipe, recipe.backward_format)
        outs.append(x_row @ w_row.t()), dxs.append(dy_row @ w_col), dws.append(dy_col.t() @ x_col)
    return torch.cat(outs), torch.cat(dxs), dws


@pytest.mark.parametrize("recipe", te.RECIPES)
def test_grouped_linear_uses_each_operand_as_te_does(recipe):
    """The operands' orientations matter where a block's amax is an outlier: the small values
    sharing its row-wise block are rounded otherwise than those sharing its column-wise one
    (e4m3's subnormal range), so a GEMM that took the other copy would differ."""
    fp8 = te.Fp8Recipe(recipe)
    m_splits = [64, 0, 96]
    rows = torch.randn(sum(m_splits), 64, generator=GEN)
    rows[0, 0] = 1e4
    rows.requires_grad_(True)
    weights = [torch.randn(32, 64, generator=GEN) for _ in m_splits]
    weights[0][0, 0] = 1e4
    weights = [w.requires_grad_(True) for w in weights]
    grad = torch.randn(sum(m_splits), 32, generator=GEN) * 1e-3
    operands = [te.WeightOperand.of_cast(w, fp8) for w in weights]
    out = te.fp8_grouped_linear(rows, m_splits, weights, operands, fp8)
    out.backward(grad)
    want_out, want_dx, want_dw = manual_grouped_linear(
        rows.detach(), [w.detach() for w in weights], m_splits, fp8, grad
    )
    assert torch.equal(out, want_out) and torch.equal(rows.grad, want_dx)
    assert all(torch.equal(w.grad, dw) for w, dw in zip(weights, want_dw))
    assert not weights[1].grad.any()  # an empty group
    if recipe != "tensorwise":  # the orientations differ: swapping them would be visible
        x_row, x_col = te.quantize_activation(rows.detach(), fp8, "e4m3")
        assert not torch.equal(x_row, x_col)
    if recipe == "mxfp8":  # blockwise weights: 2-D blocks, one copy transposed
        w_row, w_col = te.quantize_weight(weights[0].detach(), fp8)
        assert not torch.equal(w_row, w_col)


@pytest.mark.parametrize(
    "recipe", ["tensorwise", "blockwise", "mxfp8", "tensorwise-pow2", "blockwise-fp32"]
)
def test_one_quantizer_per_group(recipe):
    """One expert's rows as one group or split in two (main instance and replica). Under the block
    recipes the forward is row-local; the weight gradient sums column-wise blocks along the tokens,
    which the split regroups; under tensorwise each part has its own amax. Only power-of-two scales
    round every element of e4m3's / e5m2's normal range as the whole group would (the parts'
    scales differ by powers of two)."""
    name, _, variant = recipe.partition("-")
    fp8 = te.Fp8Recipe(name, power_2_scales={"pow2": True, "fp32": False}.get(variant))
    rows = torch.randn(320, 64, generator=GEN)
    rows[:32] *= 8.0  # the whole group's amax lies in the first part
    weight = torch.randn(32, 64, generator=GEN)
    grad = torch.randn(320, 32, generator=GEN)

    def run(m_splits):
        x = rows.clone().requires_grad_(True)
        w = [weight.clone().requires_grad_(True) for _ in m_splits]
        out = te.fp8_grouped_linear(
            x, m_splits, w, [te.WeightOperand.of_cast(v, fp8) for v in w], fp8
        )
        out.backward(grad)
        return out, sum(v.grad for v in w)

    (whole_out, whole_dw), (split_out, split_dw) = run([320]), run([96, 224])
    if name != "tensorwise":
        assert torch.equal(whole_out, split_out)  # row-wise blocks: a row is its own
    # The split against fp8's own error (the whole group's result against the exact one)
    for what, whole, split, exact in (
        ("output", whole_out, split_out, rows @ weight.t()),
        ("wgrad", whole_dw, split_dw, grad.t() @ rows),
    ):
        fp8_error = ((whole - exact).norm() / exact.norm()).item()
        split_difference = ((whole - split).norm() / whole.norm()).item()
        print(
            f"{recipe} {what}: split difference {split_difference:.3g}, fp8 error {fp8_error:.3g}"
        )
        if fp8.power_2_scales:  # invisible at fp8 resolution: e4m3's subnormal range, fp32 sums
            assert split_difference < 1e-3 * fp8_error
        elif what == "wgrad" or name == "tensorwise":  # the part without the amax rounded otherwise
            assert split_difference > 1e-1 * fp8_error
