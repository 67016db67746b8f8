"""The few-row CPU GEMM (eaglespec/cpugemm.py): same numbers as nn.Linear, and the engine that uses it
decodes exactly as the one that does not."""
from __future__ import annotations

import pytest
import torch

from eaglespec import cpugemm
from eaglespec.engine import Engine, _Timers

pytestmark = pytest.mark.skipif(cpugemm.why_unavailable() is not None,
                                reason=f"few-row GEMM unavailable: {cpugemm.why_unavailable()}")


@pytest.mark.parametrize("m,k,n", [(1, 576, 576), (2, 64, 192), (3, 7, 13), (5, 33, 8), (8, 64, 9),
                                   (9, 576, 192), (12, 40, 100), (16, 1536, 24), (17, 64, 49), (33, 16, 17),
                                   (300, 96, 1000), (0, 8, 8), (24, 48, 40), (25, 48, 33)])
@pytest.mark.parametrize("width", sorted({8, cpugemm.panel_width()}) if cpugemm.why_unavailable() is None else [8])
def test_packed_linear_equals_nn_linear(m, k, n, width, monkeypatch):
    """Both kernels (8-column AVX2 panels; 16-column AVX-512 ones where the CPU has it): every row-pass
    split (1-8 rows, 16 / 24 rows in one pass, several passes), ragged last panels (n not a multiple of
    the width), odd K (the unrolled loop's tail), with and without bias, and batch dimensions."""
    monkeypatch.setitem(cpugemm._STATE, "width", width)
    torch.manual_seed(m * 1000 + n)
    for bias in (False, True):
        lin = torch.nn.Linear(k, n, bias=bias)
        packed = cpugemm.PackedLinear(lin)
        x = torch.randn(2, m, k)
        want, got = lin(x), packed(x)
        assert got.shape == want.shape
        assert torch.equal(packed.weight, lin.weight) and packed.packed.shape[2] == width
        torch.testing.assert_close(got, want, atol=1e-5 * k ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("width", sorted({8, cpugemm.panel_width()}) if cpugemm.why_unavailable() is None else [8])
def test_a_row_gives_the_same_bits_whatever_rows_come_with_it(width, monkeypatch):
    """Greedy identity needs verification (n rows) to compute each row as plain decoding (1 row) does.
    The AVX-512 kernel reads x row by row up to 8 rows and transposed above; each row's sums must not
    depend on that, on its pass, or on the other rows, bit for bit."""
    monkeypatch.setitem(cpugemm._STATE, "width", width)
    torch.manual_seed(3)
    for k in (576, 1536, 37):
        packed = cpugemm.PackedLinear(torch.nn.Linear(k, 70, bias=False))
        x = torch.randn(60, k)
        alone = torch.cat([packed(x[i:i + 1]) for i in range(60)])
        for m in (2, 8, 9, 16, 24, 25, 60):
            assert torch.equal(packed(x[:m]), alone[:m]), (k, m)

def test_fused_linears_equal_the_separate_ones_concatenated():
    """q/k/v (with a bias on some, as Qwen2 has on all three) and gate/up run as one packed call."""
    torch.manual_seed(1)
    parts = [torch.nn.Linear(48, 64, bias=True), torch.nn.Linear(48, 16, bias=False), torch.nn.Linear(48, 16, bias=True)]
    fused = cpugemm.PackedLinear(*parts)
    x = torch.randn(3, 7, 48)
    torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], -1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mixtral"])
def test_a_packed_target_gives_the_same_logits(tiny_checkpoint, family):
    """Whole targets (qkv bias, q/k norms, MoE experts): the packed, fused forward equals the nn.Linear one."""
    from eaglespec.loading import load_target
    ref, _ = load_target(str(tiny_checkpoint(family)), device="cpu", dtype=torch.float32)
    packed, _ = load_target(str(tiny_checkpoint(family)), device="cpu", dtype=torch.float32)
    assert cpugemm.pack_linears(packed) > 0
    toks = torch.tensor([[1, 4, 9, 16, 25, 36]])
    pos = torch.arange(6)[None]
    with torch.inference_mode():
        torch.testing.assert_close(packed(toks, pos)[1], ref(toks, pos)[1], atol=1e-4, rtol=1e-4)


def test_packed_linear_takes_strided_input_and_rejects_a_wrong_width():
    lin = torch.nn.Linear(32, 24)
    packed = cpugemm.PackedLinear(lin)
    x = torch.randn(6, 64)[:, ::2]  # not contiguous
    torch.testing.assert_close(packed(x), lin(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="input has 31 features, weight 32"):
        packed(torch.randn(3, 31))


def test_packed_linear_compiles_to_the_same_numbers():
    torch._dynamo.reset()
    lin = torch.nn.Linear(64, 40, bias=True)
    packed = cpugemm.PackedLinear(lin).eval()
    fn = torch.compile(lambda x: torch.relu(packed(x)) * 2, fullgraph=True)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        torch.testing.assert_close(fn(x), torch.relu(lin(x)) * 2, atol=1e-5, rtol=1e-5)


def test_engine_swaps_the_target_linears_and_decodes_as_before(make_oracle_pair, same_or_tie):
    """Greedy output of a packed engine equals an unpacked engine's on the same weights, for plain
    decoding and EAGLE (each also equal to the other within its engine)."""
    model_a, head_a = make_oracle_pair(noise=0.3)
    model_b, head_b = make_oracle_pair(noise=0.3)
    plain = Engine(model_a, None, head_a, packed_gemm=False)
    packed = Engine(model_b, None, head_b)
    assert not plain.packed_gemm and packed.packed_gemm
    assert not any(isinstance(m, cpugemm.PackedLinear) for m in model_a.modules())
    assert not any(isinstance(m, torch.nn.Linear) for m in model_b.modules())
    assert all(hasattr(layer.self_attn, "qkv_proj") and hasattr(layer.mlp, "gate_up_proj") for layer in model_b.layers)
    # the head and the draft LM-head rows run on it too, the head as a packed copy (q/k/v kept apart)
    # that shares its other tensors: the caller's head and its state dict are left as they were
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.head.modules())
    assert hasattr(packed.head.layers[0].self_attn, "q_proj") and isinstance(packed._draft_lm, cpugemm.PackedLinear)
    assert any(isinstance(m, torch.nn.Linear) for m in head_b.modules()) and "fc.weight" in head_b.state_dict()
    for prompt in ([1, 5, 9, 2], [3, 3, 7, 11, 4, 8]):
        want = plain.generate(input_ids=prompt, method="vanilla", max_new_tokens=24, temperature=0).token_ids
        for method in ("vanilla", "eagle"):
            got = packed.generate(input_ids=prompt, method=method, max_new_tokens=24, temperature=0).token_ids
            same_or_tie(model_a, prompt, got, want)


@pytest.mark.skipif(not cpugemm.huge_pages_enabled(), reason="transparent huge pages are Linux's (madvise)")
def test_packed_weights_move_onto_huge_pages_with_the_same_bits(make_oracle_pair, monkeypatch):
    """The engine's packed weights (target, head, draft LM-head rows) sit in 2 MiB-aligned mappings advised
    for huge pages, each tensor on a line of its own, and give the same logits as before the move;
    EAGLESPEC_HUGEPAGES=0 leaves them where torch put them."""
    lins = [cpugemm.PackedLinear(torch.nn.Linear(64, n)) for n in (48, 80, 16)]
    x = torch.randn(3, 64)
    want = [lin(x) for lin in lins]
    if not cpugemm.onto_huge_pages(cpugemm.packed_slots(torch.nn.ModuleList(lins))):
        pytest.skip("this kernel refuses MADV_HUGEPAGE")
    ptrs = [lin.packed.data_ptr() for lin in lins]
    assert ptrs[0] % cpugemm.HUGE_PAGE == 0 and all(p % 64 == 0 for p in ptrs) and len(set(ptrs)) == 3
    _ = [torch.randn(256, 1024) for _ in range(8)]  # the mapping outlives the call that made it
    assert all(torch.equal(lin(x), w) for lin, w in zip(lins, want))

    model, head = make_oracle_pair()
    engine = Engine(model, None, head)
    starts = {mod: min(m.packed.data_ptr() for m in mod.modules() if isinstance(m, cpugemm.PackedLinear))
              for mod in (model, engine.head, engine._draft_lm)}
    assert all(p % cpugemm.HUGE_PAGE == 0 for p in starts.values())
    monkeypatch.setenv("EAGLESPEC_HUGEPAGES", "0")
    assert not cpugemm.onto_huge_pages(cpugemm.packed_slots(torch.nn.ModuleList(lins)))
    model2, head2 = make_oracle_pair()
    plain = Engine(model2, None, head2)
    prompt = [1, 5, 9, 2]
    for method in ("vanilla", "eagle"):
        assert (engine.generate(input_ids=prompt, method=method, max_new_tokens=16, temperature=0).token_ids
                == plain.generate(input_ids=prompt, method=method, max_new_tokens=16, temperature=0).token_ids)


def test_packed_gemm_can_be_turned_off(make_oracle_pair, monkeypatch):
    model, head = make_oracle_pair()
    assert not Engine(model, None, head, packed_gemm=False).packed_gemm
    monkeypatch.setitem(cpugemm._STATE, "why", "disabled by EAGLESPEC_CPU_GEMM=0")
    model, head = make_oracle_pair()
    assert not Engine(model, None, head).packed_gemm


def test_a_compiled_packed_engine_verifies_every_size_with_one_graph(make_oracle_pair, same_or_tie):
    """With every GEMM on the packed op, the target's verification is one graph for all sizes >= 2
    (plus the static one-token step): a new process loads 2 graphs, not one per tree size. Its
    outputs still equal the eager engine's."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    model, head = make_oracle_pair(noise=0.3)
    engine = Engine(model, None, head, compile="default")
    assert engine.packed_gemm and engine._target_call.dynamic_t
    counters.clear()
    for n in (1, 3, 5, 8, 16):
        engine.time_verify_call(n, 20)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    eager = Engine(model, None, head)
    for prompt in ([1, 5, 9, 2], [3, 3, 7, 11, 4, 8]):
        want = eager.generate(input_ids=prompt, method="vanilla", max_new_tokens=20, temperature=0).token_ids
        got = engine.generate(input_ids=prompt, method="eagle", max_new_tokens=20, temperature=0).token_ids
        same_or_tie(model, prompt, got, want)


# ---- the attention kernel (cpugemm's small_attention) --------------------------------------------------

needs_attention = pytest.mark.skipif(cpugemm.why_unavailable() is not None or not cpugemm.attention_available(),
                                     reason="the attention kernel needs AVX-512")


def _sdpa(q, k, v, mask):
    """torch's attention, in the kernel's output layout (b, t, heads, dim)."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)


def _cache(b, kv, length, d, slots=200):
    """k, v as the engine reads them: a prefix view of a longer preallocated cache."""
    return torch.randn(b, kv, slots, d)[:, :, :length], torch.randn(b, kv, slots, d)[:, :, :length]


@needs_attention
@pytest.mark.parametrize("b,h,kv,t,length,d", [(1, 9, 3, 1, 130, 64), (1, 9, 3, 16, 150, 64), (1, 4, 4, 3, 17, 32),
                                               (3, 8, 2, 1, 64, 128), (2, 4, 1, 5, 40, 16), (1, 2, 1, 33, 60, 256)])
def test_small_attention_equals_sdpa(b, h, kv, t, length, d):
    """Tree masks (a shared prefix, then each node's ancestors), per-row lengths of a batch, grouped and
    plain multi-head attention, every supported head size, the query as a transposed view."""
    torch.manual_seed(b * 100 + t)
    k, v = _cache(b, kv, length, d)
    q = torch.randn(b, t, h, d).transpose(1, 2)
    if b == 1:
        ctx = length - t - 2
        mask = torch.zeros(t, length, dtype=torch.bool)
        mask[:, :ctx] = True
        mask[:, ctx:ctx + t] = (torch.rand(t, t) < 0.5).tril() | torch.eye(t, dtype=torch.bool)
    else:
        lens = torch.randint(1, length + 1, (b,))
        mask = (torch.arange(length)[None] < lens[:, None])[:, None, None, :].expand(b, 1, t, length)
    got = torch.ops.eaglespec.small_attention(q, k, v, mask, d ** -0.5)
    assert got.shape == (b, t, h, d)
    torch.testing.assert_close(got, _sdpa(q, k, v, mask), atol=2e-6, rtol=1e-5)


@needs_attention
def test_small_attention_rows_depend_on_nothing_but_their_own_keys():
    """Bit for bit: a query row's result is the same alone or among other rows (one token or a tree of
    eight, one sequence or a batch), and with masked padding keys after its own. So plain decoding and
    verification attend identically, and so do batched and one-at-a-time regeneration."""
    torch.manual_seed(3)
    k, v = _cache(4, 3, 96, 64)
    q = torch.randn(4, 9, 8, 64)
    mask = torch.ones(4, 1, 8, 96, dtype=torch.bool)
    mask[..., 70:] = False
    op = torch.ops.eaglespec.small_attention
    full = op(q, k, v, mask, 0.125)
    one = op(q[2:3, :, 5:6], k[2:3], v[2:3], mask[2:3, :, 5:6], 0.125)
    assert torch.equal(one[0, 0], full[2, 5])
    short = op(q[2:3, :, 5:6], k[2:3, :, :70], v[2:3, :, :70], mask[2:3, :, 5:6, :70], 0.125)
    assert torch.equal(short[0, 0], full[2, 5])


@needs_attention
def test_a_tree_node_attends_with_the_bits_of_its_path_in_consecutive_slots():
    """Bit for bit: a tree node whose ancestors sit in scattered slots (a verification round) gets what the
    same keys in consecutive slots give (plain decoding of the accepted path). Without it, verification and
    plain decoding differ in the last bits, which int8 activations blow up into different tokens."""
    torch.manual_seed(4)
    ctx, d = 37, 64
    k, v = _cache(1, 3, 80, d)
    q = torch.randn(1, 9, 1, d)
    path = [ctx, ctx + 3, ctx + 9, ctx + 20]  # root, a child, a grandchild, the node itself
    tree_mask = torch.zeros(1, 80, dtype=torch.bool)
    tree_mask[0, :ctx] = True
    tree_mask[0, path] = True
    keep = list(range(ctx)) + path
    kc, vc = k[:, :, keep], v[:, :, keep]  # the same keys, consecutive (as plain decoding has them)
    line_mask = torch.ones(1, len(keep), dtype=torch.bool)
    op = torch.ops.eaglespec.small_attention
    assert torch.equal(op(q, k, v, tree_mask, d ** -0.5), op(q, kc, vc, line_mask, d ** -0.5))


@needs_attention
def test_small_attention_gives_zeros_for_a_row_that_sees_nothing_and_checks_its_inputs():
    k, v = _cache(1, 2, 20, 32)
    q = torch.randn(1, 4, 2, 32)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1] = False
    out = torch.ops.eaglespec.small_attention(q, k, v, mask, 0.2)
    assert torch.equal(out[0, 1], torch.zeros(4, 32)) and out[0, 0].abs().sum() > 0
    with pytest.raises(RuntimeError, match="head_dim"):
        torch.ops.eaglespec.small_attention(q[..., :24], k[..., :24], v[..., :24], mask, 0.2)
    with pytest.raises(RuntimeError, match="bool mask"):
        torch.ops.eaglespec.small_attention(q, k, v, mask.float(), 0.2)


@needs_attention
def test_packing_switches_attention_to_the_kernel_and_it_compiles(make_oracle_pair):
    """The packed engine's target and head attend with the kernel; compiled, the kernel is one opaque
    call in the graph and gives the eager numbers."""
    from eaglespec.model import Attention
    model, head = make_oracle_pair()
    engine = Engine(model, None, head)
    assert all(m.small_attention for m in list(model.modules()) + list(engine.head.modules()) if isinstance(m, Attention))
    torch._dynamo.reset()
    k, v = _cache(1, 3, 50, 64)
    q, mask = torch.randn(1, 9, 4, 64), torch.ones(4, 50, dtype=torch.bool)
    fn = torch.compile(lambda q, k, v, m: torch.ops.eaglespec.small_attention(q, k, v, m, 0.125) * 2, fullgraph=True)
    torch.testing.assert_close(fn(q, k, v, mask), 2 * torch.ops.eaglespec.small_attention(q, k, v, mask, 0.125))


# ---- weights kept as their GGUF blocks ----------------------------------------------------------------

needs_quant = pytest.mark.skipif(cpugemm.why_unavailable() is not None or cpugemm.panel_width() != 16,
                                 reason="the GGUF-block kernel needs the AVX-512 one")


def gguf_q4_1(w: torch.Tensor) -> torch.Tensor:
    """w through llama.cpp's Q4_1 quantizer (d = (max - min) / 15, m = min, both fp16) and gguf-py's
    dequantizer (d * q + m in fp32): what a Q4_1 GGUF's converted weights hold."""
    n, k = w.shape
    b = w.reshape(n, k // 32, 32)
    lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
    d = ((hi - lo) / 15).half().float()
    m = lo.half().float()
    q = ((b - lo) / torch.where(d > 0, d, torch.ones_like(d))).round().clamp(0, 15)
    return (d * q + m).reshape(n, k)


gguf_q8_0 = cpugemm.q8_0_round  # llama.cpp's Q8_0 quantizer and gguf-py's dequantizer, as the library rounds draft heads


def as_gguf_blocks(model):
    """`model` with its weights rounded as a Q4_1 GGUF file holds them (the LM head Q8_0), in place."""
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and mod.in_features % 32 == 0:
                mod.weight.copy_(gguf_q8_0(mod.weight) if name == "lm_head" else gguf_q4_1(mod.weight))
    return model


@needs_quant
@pytest.mark.parametrize("kind,make", [(cpugemm.Q4_1, gguf_q4_1), (cpugemm.Q8_0, gguf_q8_0)])
@pytest.mark.parametrize("n,k", [(16, 32), (40, 64), (49, 576), (960, 576), (24, 1536)])
def test_gguf_block_weights_run_packed_as_blocks_bit_for_bit(kind, make, n, k, monkeypatch):
    """Found, packed at 5-9 bits a weight, unpacked exactly, and every row count (one pass, several,
    transposed or not; ragged last panel) gives the fp32 kernel's bits, with and without bias."""
    monkeypatch.setenv("EAGLESPEC_CPU_QUANT", "1")  # the exact kernel (the default is int8 activations)
    torch.manual_seed(n + k)
    w = torch.randn(n, k) * 0.05
    w[0, :32] = w[0, 0]  # a constant block (Q4_1: d = 0)
    w[1, -32:] = 0.0  # an all-zero block (Q8_0: d = 0)
    w = make(w)
    got = cpugemm.quant_pack(w)
    assert got is not None and got[0] == kind
    assert torch.equal(cpugemm.quant_unpack(kind, got[1], n), w)
    for bias in (False, True):
        lin = torch.nn.Linear(k, n, bias=bias)
        lin.weight.data = w
        blocks, fp32 = cpugemm.PackedLinear(lin), cpugemm.PackedLinear(lin, quant=False)
        assert blocks.kind == kind and fp32.kind == 0 and torch.equal(blocks.weight, w)
        assert blocks.packed.numel() * 8 == -(-n // 16) * 16 * k * (9 if kind == cpugemm.Q8_0 else 6)  # bits a weight
        for m in (0, 1, 2, 3, 8, 9, 16, 24, 25, 49):
            x = torch.randn(2, m, k)
            assert torch.equal(blocks(x), fp32(x)), (m, bias)


@needs_quant
@pytest.mark.parametrize("mode", ["1", "int8"])
def test_weights_that_are_not_exact_blocks_stay_fp32(mode, monkeypatch):
    monkeypatch.setenv("EAGLESPEC_CPU_QUANT", mode)
    torch.manual_seed(5)
    assert cpugemm.quant_pack(torch.randn(64, 64)) is None  # trained fp32 weights
    assert cpugemm.quant_pack(torch.randn(64, 48)) is None  # K not a multiple of 32
    w = gguf_q4_1(torch.randn(64, 64))
    w[7, 40] = torch.nextafter(w[7, 40], torch.tensor(1.0))  # one value off by one ulp
    assert cpugemm.quant_pack(w) is None
    lin = torch.nn.Linear(64, 64, bias=False)
    lin.weight.data = w
    assert cpugemm.PackedLinear(lin).kind == 0


@pytest.mark.parametrize("kind,make", [(cpugemm.Q4_1, gguf_q4_1), (cpugemm.Q8_0, gguf_q8_0)])
@pytest.mark.parametrize("n,k", [(8, 32), (13, 64), (49, 576), (960, 576), (24, 1536)])
def test_gguf_blocks_on_8_column_panels_give_the_fp32_panels_bits(kind, make, n, k):
    """AVX2 (runs on any machine with the packed kernel): blocks on 8-column panels, packed at 6 / 9 bits
    a weight beside the fp32 panels, unpacked exactly; every row count, whichever of the two it reads
    (`block_rows` 0, 3, 8), gives the fp32 panels' bits, with and without bias, ragged last panel."""
    torch.manual_seed(n + k)
    w = torch.randn(n, k) * 0.05
    w[0, :32] = w[0, 0]  # a constant block (Q4_1: d = 0)
    w[1, -32:] = 0.0  # an all-zero block (Q8_0: d = 0)
    w = make(w)
    got = cpugemm.quant_pack(w, width=8)
    assert got is not None and got[0] == kind
    assert torch.equal(cpugemm.quant_unpack(kind, got[1], n), w)
    assert got[1].numel() * 8 == -(-n // 8) * 8 * k * (9 if kind == cpugemm.Q8_0 else 6)  # bits a weight
    for bias in (False, True):
        lin = torch.nn.Linear(k, n, bias=bias)
        lin.weight.data = w
        blocks, fp32 = cpugemm.PackedLinear(lin, quant=True, width=8), cpugemm.PackedLinear(lin, quant=False, width=8)
        assert blocks.kind == kind and fp32.kind == 0 and fp32.panels is None
        assert torch.equal(blocks.weight, w) and torch.equal(blocks.panels, fp32.packed)
        for rows in (0, 3, 8):
            blocks.block_rows = rows
            for m in (0, 1, 2, 3, 4, 5, 8, 9, 16, 25):
                x = torch.randn(2, m, k)
                assert torch.equal(blocks(x), fp32(x)), (rows, m, bias)


def test_8_column_blocks_compile_to_the_same_numbers_and_refuse_bad_input():
    torch.manual_seed(3)
    lin = torch.nn.Linear(64, 40, bias=True)
    lin.weight.data = gguf_q4_1(lin.weight.data)
    blocks = cpugemm.PackedLinear(lin, quant=True, width=8)
    fn = torch.compile(blocks, backend="inductor", fullgraph=True)
    for m in (2, 5):  # one graph over the blocks' and the panels' row counts
        x = torch.randn(1, m, 64)
        assert torch.equal(fn(x), blocks(x))
    with pytest.raises(RuntimeError, match="max_rows is 0-8"):
        torch.ops.eaglespec.quant_mm8(torch.randn(2, 64), blocks.packed, blocks.panels, 40, 4, 9)
    with pytest.raises(RuntimeError, match="input has 32 features"):
        torch.ops.eaglespec.quant_mm8(torch.randn(2, 32), blocks.packed, blocks.panels, 40, 4, 3)


@pytest.mark.parametrize("raw", ["9", "-1", "x"])
def test_a_bad_block_rows_setting_is_one_clear_error(raw, monkeypatch):
    monkeypatch.setenv("EAGLESPEC_CPU_QUANT_ROWS", raw)
    with pytest.raises(ValueError, match="EAGLESPEC_CPU_QUANT_ROWS must be a whole number from 0 to 8"):
        cpugemm.block_rows()


@pytest.mark.parametrize("width", sorted({8, cpugemm.panel_width()}) if cpugemm.why_unavailable() is None else [8])
def test_an_engine_on_gguf_blocks_decodes_as_on_fp32_weights(make_oracle_pair, monkeypatch, width):
    """A target whose weights are Q4_1 blocks (and a Q8_0 LM head) runs its linears as blocks (on
    16-column panels with AVX-512, on 8-column ones with AVX2, forced here where both run); plain
    decoding and EAGLE give exactly the tokens of the same target on fp32 panels. The calibration key
    tells the two apart, so neither sizes trees with the other's costs."""
    from eaglespec import costmodel
    monkeypatch.setitem(cpugemm._STATE, "width", width)
    pairs = []
    for quant in ("1", "0"):
        monkeypatch.setenv("EAGLESPEC_CPU_QUANT", quant)
        model, head = make_oracle_pair(noise=0.3)
        pairs.append(Engine(as_gguf_blocks(model), None, head))
    blocks, fp32 = pairs
    kinds = {m.kind for m in blocks.model.modules() if isinstance(m, cpugemm.PackedLinear)}
    assert cpugemm.Q4_1 in kinds and {m.kind for m in fp32.model.modules() if isinstance(m, cpugemm.PackedLinear)} == {0}
    assert "+gguf" in costmodel.table_key(blocks)["gemm"] and costmodel.table_key(fp32) != costmodel.table_key(blocks)
    # the draft head runs on Q8_0 blocks too (rounded: a draft only proposes), the fp32 engine's does not
    assert {m.kind for m in blocks.head.modules() if isinstance(m, cpugemm.PackedLinear)} == {cpugemm.Q8_0}
    assert {m.kind for m in fp32.head.modules() if isinstance(m, cpugemm.PackedLinear)} == {0}
    for prompt in ([1, 5, 9, 2], [3, 3, 7, 11, 4, 8]):
        want = fp32.generate(input_ids=prompt, method="vanilla", max_new_tokens=24, temperature=0).token_ids
        for method in ("vanilla", "eagle"):
            assert blocks.generate(input_ids=prompt, method=method, max_new_tokens=24, temperature=0).token_ids == want


@needs_quant
@pytest.mark.parametrize("mode", ["1", "int8"])
def test_gguf_block_kernel_compiles_to_the_same_numbers(mode, monkeypatch):
    monkeypatch.setenv("EAGLESPEC_CPU_QUANT", mode)
    torch.manual_seed(2)
    lin = torch.nn.Linear(64, 40, bias=True)
    lin.weight.data = gguf_q4_1(lin.weight.data)
    blocks = cpugemm.PackedLinear(lin)
    assert blocks.kind == (cpugemm.Q4_1 if cpugemm.quant_mode() == "1" else cpugemm.Q4_1_I8)
    x = torch.randn(3, 5, 64)
    assert torch.equal(torch.compile(blocks, backend="inductor", fullgraph=True)(x), blocks(x))


needs_int8 = pytest.mark.skipif(cpugemm.why_unavailable() is not None or cpugemm.panel_width() != 16
                                or not bool(torch.ops.eaglespec.cpu_has_vnni()),
                                reason="the int8-activation kernel needs AVX-512 VNNI")


def int8_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What quant_mm_i8 computes, in fp64: each row's blocks of 32 rounded to int8 (d = max |x| / 127,
    q = round(x / d)), times the fp32 weight."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    q = torch.where(amax > 0, torch.round(xb * (127 / amax)), torch.zeros_like(xb)).clamp(-127, 127)
    return (q * (amax / 127)).reshape(m, k).double() @ w.double().T


@needs_int8
@pytest.mark.parametrize("kind,make", [(cpugemm.Q4_1_I8, gguf_q4_1), (cpugemm.Q8_0_I8, gguf_q8_0)])
@pytest.mark.parametrize("n,k", [(16, 32), (40, 64), (960, 576), (24, 1536)])
def test_int8_activation_kernel_computes_int8_blocks_times_the_weights(kind, make, n, k):
    """Packed in its own layout and unpacked exactly; every row count gives the int8-rounded product
    (to fp32 rounding), and a row's bits do not depend on the rows computed with it (one pass, several,
    the 1-3-row kernels that split each sum), with and without bias."""
    torch.manual_seed(n + k)
    w = torch.randn(n, k) * 0.05
    w[0, :32] = w[0, 0]
    w[1, -32:] = 0.0
    w = make(w)
    got = cpugemm.quant_pack(w, int8=True)
    assert got is not None and got[0] == kind
    assert torch.equal(cpugemm.quant_unpack(kind, got[1], n), w)
    assert got[1].numel() * 8 == -(-n // 16) * 16 * k * (9 if kind == cpugemm.Q8_0_I8 else 5)  # bits a weight
    for m in (1, 2, 3, 4, 9, 16, 17, 40):
        x = torch.randn(m, k)
        x[0, :32] = 0.0  # an all-zero block of x (d = 0)
        if m > 1:  # a block whose largest |x| is negative, and halves: x / d lands on .5, which rounds to even
            x[1, :32] = torch.arange(32) % 8 - 4.5
            x[1, 0] = -127.0
        y = torch.ops.eaglespec.quant_mm(x, got[1], n, kind)
        ref = int8_reference(x, w)
        assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max(), m
        alone = torch.cat([torch.ops.eaglespec.quant_mm(x[i:i + 1], got[1], n, kind) for i in range(m)])
        assert torch.equal(y, alone), m
    lin = torch.nn.Linear(k, n, bias=True)
    lin.weight.data = w
    x = torch.randn(2, 5, k)
    packed = cpugemm.PackedLinear(lin)  # the default mode
    if cpugemm.quant_mode() == "int8":
        assert packed.kind == kind
        assert torch.equal(packed(x), torch.ops.eaglespec.quant_mm(x, got[1], n, kind) + lin.bias)


@needs_int8
@pytest.mark.parametrize("draft_q8", ["1", "0"])
def test_an_engine_on_int8_activations_decodes_as_its_own_plain_decoding(make_oracle_pair, monkeypatch, draft_q8):
    """EAGLESPEC_CPU_QUANT=int8: the target's GGUF blocks times int8 activations. Its tokens are not the
    fp32 weights' (not compared), but EAGLE's are plain decoding's on the same engine token for token,
    no tie allowed: every kernel on the way (GEMM, attention) gives a row the same bits in a tree as
    alone. The calibration key is its own."""
    from eaglespec import costmodel
    monkeypatch.setenv("EAGLESPEC_CPU_QUANT", "int8")
    monkeypatch.setenv("EAGLESPEC_DRAFT_Q8", draft_q8)
    model, head = make_oracle_pair(noise=0.3)
    engine = Engine(as_gguf_blocks(model), None, head)
    kinds = {m.kind for m in engine.model.modules() if isinstance(m, cpugemm.PackedLinear)}
    assert cpugemm.Q4_1_I8 in kinds and cpugemm.Q4_1 not in kinds
    assert "+gguf-int8" in costmodel.table_key(engine)["gemm"]
    torch.manual_seed(0)
    for prompt in ([1, 5, 9, 2], [3, 3, 7, 11, 4, 8], torch.randint(0, 200, (40,)).tolist()):
        want = engine.generate(input_ids=prompt, method="vanilla", max_new_tokens=40, temperature=0).token_ids
        got = engine.generate(input_ids=prompt, method="eagle", max_new_tokens=40, temperature=0)
        assert got.token_ids == want


@needs_int8
@needs_attention
def test_int8_verification_rows_have_the_decoding_steps_bits_at_any_tree_size(make_oracle_pair, monkeypatch):
    """Every row of a verification, up to 64 of them, gives the logits the one-token step gives at that
    position, bit for bit: on int8 activations a last-bit difference in attention grows into other tokens.
    (Up to the thirty-ninth session attention above 32 rows went to torch's kernel: a 60-node tree then lost
    losslessness on the default model.)"""
    monkeypatch.setenv("EAGLESPEC_CPU_QUANT", "int8")
    model, head = make_oracle_pair(noise=0.3)
    engine = Engine(as_gguf_blocks(model), None, head)
    torch.manual_seed(1)
    prompt = torch.randint(0, 200, (30,)).tolist()
    tokens = torch.randint(0, 200, (64,))
    for n in (17, 33, 64):
        with torch.inference_mode():
            engine._ensure_cache(256)
            engine._prefill(prompt, _Timers())
            cur = len(prompt)
            _, rows, _ = engine._verify_forward(tokens[:n], torch.arange(cur, cur + n), cur,
                                                mask=torch.ones(n, n, dtype=torch.bool).tril())
            for i in range(n):
                _, one, _ = engine._verify_forward(tokens[i:i + 1], torch.tensor([cur + i]), cur + i)
                assert torch.equal(rows[i], one[0]), (n, i)


def test_a_bad_quant_mode_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("EAGLESPEC_CPU_QUANT", "int4")
    with pytest.raises(ValueError, match="EAGLESPEC_CPU_QUANT must be one of"):
        cpugemm.quant_mode()


def test_tree_draws_kernel_draws_as_its_reference_and_checks_its_inputs():
    """cpugemm's tree_draws against verify.tree_draws on the same uniforms: the same token at every node (the
    sums' order differs, so a uniform within rounding of a boundary may split them; none does here), with a
    reduced draft vocabulary, nodes without children and tries of every rank, and chain tokens tried first (`det`:
    none, one the head drew too, one of the draft vocabulary, one off it). A drafted token the head could not have
    drawn is refused."""
    from eaglespec.verify import tree_draws
    g = torch.Generator().manual_seed(0)
    n, vocab, vq, k = 6, 500, 200, 4
    ids = torch.randperm(vocab, generator=g)[:vq].sort().values
    of = torch.full((vocab,), -1, dtype=torch.long)
    of[ids] = torch.arange(vq)
    same = total = rejected = chain_taken = chain_rejected = 0
    for _ in range(300):
        p = torch.softmax(2 * torch.randn(n, vocab, generator=g), -1)
        q = torch.softmax(2 * torch.randn(n, vq, generator=g), -1)
        kid_ok = torch.rand(n, k, generator=g) < 0.6
        kids = ids[torch.multinomial(q, k, generator=g)]  # without replacement, in drawing order
        u = torch.rand(n, k + 2, generator=g, dtype=torch.float64)
        kind = torch.randint(0, 4, (n,), generator=g)  # no chain token, the head's first child, any token, p's argmax
        det = torch.where(kind == 0, -1, torch.where(kind == 1, kids[:, 0], torch.where(
            kind == 2, torch.randint(0, vocab, (n,), generator=g), p.argmax(-1))))
        got = torch.ops.eaglespec.tree_draws(p, q, ids, of, kids, kid_ok, det, u)
        ref = tree_draws(p, torch.zeros(n, vocab).index_copy(1, ids, q), kids, kid_ok, u, det)
        same += int((got == ref).sum())
        total += n
        rejected += int((kid_ok.any(1) & ~(kids == got[:, None]).any(1) & (det < 0)).sum())
        chain_taken += int(((det >= 0) & (got == det)).sum())
        chain_rejected += int(((det >= 0) & (got != det)).sum())
    assert same == total and rejected > total // 8  # and many nodes rejected every child they tried
    assert chain_taken > 20 and chain_rejected > total // 4  # p is flat over 500 tokens: a chain token is rarely taken
    with pytest.raises(RuntimeError, match="no draft probability"):
        bad = torch.tensor([[int((of < 0).nonzero()[0]), 0, 0, 0]])
        torch.ops.eaglespec.tree_draws(p[:1], q[:1], ids, of, bad, torch.tensor([[True, False, False, False]]),
                                       torch.tensor([-1]), u[:1])
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        torch.ops.eaglespec.tree_draws(p[:1], q[:1], ids, of, kids[:1], kid_ok[:1], torch.tensor([vocab]), u[:1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_move_slots_kernel_equals_index_copy_and_checks_its_inputs(dtype):
    """cpugemm's move_slots (the cache compaction after a verification) copies exactly as KVCache.move_slots'
    gather-then-index_copy_ does, for every buffer, also where sources and destinations overlap."""
    g = torch.Generator().manual_seed(0)
    bufs = [torch.randn(1, 3, 40, 8, generator=g).to(dtype) for _ in range(4)] + [torch.randn(2, 1, 40, 4, generator=g)]
    want = [b.clone() for b in bufs]
    src = torch.tensor([11, 10, 15, 13, 14, 30])  # overlaps dst: slots 10 and 11 swap, 13 stays
    dst = torch.tensor([10, 11, 12, 13, 33, 34])
    for b in want:
        b.index_copy_(2, dst, b.index_select(2, src))
    torch.ops.eaglespec.move_slots(bufs, src, dst)
    assert all(torch.equal(a, b) for a, b in zip(bufs, want))
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.eaglespec.move_slots(bufs, torch.tensor([40]), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.eaglespec.move_slots([bufs[0].transpose(1, 2)], src, dst)
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.eaglespec.move_slots(bufs, src.int(), dst)
