"""The fused CPU decode kernels (`akv_core.kernels.cpu_gemv`) against torch: int4 / int8 products with their
prologues, decode attention with RoPE and the K/V write, the model's fused decode step, and the fallback."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from akv_core.kernels import cpu_gemv
from akv_core.model.quantized import Int4Groups, Int4Linear, Int8Linear

pytestmark = pytest.mark.filterwarnings("ignore:fbgemm_linear_fp16_weight_fp32_activation is deprecated")
needs_kernel = pytest.mark.skipif(not cpu_gemv.available(), reason=f"cpu_gemv: {cpu_gemv.why_unavailable()}")


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@needs_kernel
def test_products_are_exact_on_inputs_that_quantize_exactly():
    """Integer inputs whose blocks reach 127 quantize with scale 1, and small-integer weights are held exactly:
    the kernels must then return the exact product (a layout or sign error cannot hide in a tolerance), for
    every row count the kernels take (rows run 4 at a time: full and partial sets) and a column count that
    leaves the last group of 8 columns part empty."""
    n, k, most = 43, 96, cpu_gemv.max_rows()
    x = torch.randint(-127, 128, (most, k), generator=generator(0)).float()
    x.view(most, -1, 32)[:, :, 0] = 127.0
    q4 = torch.randint(0, 16, (n, k), generator=generator(1))
    scale4, offset4 = (torch.randint(1, 5, (n, k // 32), generator=generator(s)) * 0.5 for s in (2, 3))
    groups = Int4Groups.from_values(q4, scale4, -offset4)
    q8 = torch.randint(-127, 128, (n, k), generator=generator(4)).to(torch.int8)
    scale8 = torch.randint(1, 5, (n,), generator=generator(5)) * 0.25
    packed4, packed8 = cpu_gemv.pack_q4(groups.values(), groups.scale, groups.offset), cpu_gemv.pack_q8(q8, scale8)
    for rows in range(1, most + 1):
        got4, got8 = cpu_gemv.gemv(x[:rows], packed4), cpu_gemv.gemv(x[:rows], packed8)
        assert torch.equal(got4, x[:rows].double().matmul(groups.dequantize().double().T).float()), rows
        assert torch.equal(got8, (x[:rows].double() @ (q8.double() * scale8.double()[:, None]).T).float()), rows


def rounding_bound(h: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """What rounding the input rows h [M, K] to int8 per block of 32 (step amax / 127) can change in h @ held.T:
    at most one step per input (half a step, doubled for fp32 differences in the prologue), times |weight|."""
    step = h.reshape(h.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 127
    return step.expand(-1, -1, 32).reshape(h.shape) @ held.abs().T + 1e-5


def prologue_case(rows: int, seed: int, n: int = 68, k: int = 128, eps: float = 1e-5) -> tuple:
    """A weight [n, k], a norm weight and eps, inputs x [rows, k] and gate/up [rows, 2k], a residual [rows, n],
    and what the prologues make of the inputs in torch: RMSNorm(x) * norm and SiLU(gate) * up."""
    weight = torch.randn(n, k, generator=generator(seed)) * 0.05
    norm = torch.rand(k, generator=generator(seed + 1)) + 0.5
    x = torch.randn(rows, k, generator=generator(seed + 2))
    gate_up = torch.randn(rows, 2 * k, generator=generator(seed + 3))
    residual = torch.randn(rows, n, generator=generator(seed + 4))
    normed = norm * (x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt())
    swiglu = F.silu(gate_up[:, :k]) * gate_up[:, k:]
    return weight, norm, eps, x, gate_up, residual, normed, swiglu


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_prologues_and_accumulation_match_torch(rows: int):
    """RMSNorm and SwiGLU of the input, and the product added into `out`, within the int8 rounding of the input."""
    weight, norm, eps, x, gate_up, residual, normed, swiglu = prologue_case(rows, seed=3)
    for layer in (Int4Linear(Int4Groups.quantize(weight)), Int8Linear(weight)):
        held = layer.groups.dequantize() if isinstance(layer, Int4Linear) else layer.dequantize()
        cases = [(x, cpu_gemv.Prologue(norm, eps), normed), (gate_up, cpu_gemv.Prologue(glu=True), swiglu)]
        for inputs, prologue, h in cases:
            expected = residual + h @ held.T
            out = residual.clone()
            assert layer.product(inputs, prologue, out=out) is out
            assert ((out - expected).abs() <= rounding_bound(h, held)).all()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_dense_fp32_products_with_prologues_match_torch(rows: int):
    """fp32 weights as loaded (`cpu_gemv.dense`, a float32 Linear's `product`): RMSNorm and SwiGLU of the input,
    the product written or added into `out`, within fp32 rounding of torch's; bit for bit the same on any
    thread count and beside any other rows (each output is its row's own sum)."""
    from akv_core.model.linear import Linear

    weight, norm, eps, x, gate_up, residual, normed, swiglu = prologue_case(rows, seed=30)
    layer = Linear(weight)
    assert layer.fused and layer.kernel_weights().bits == 32
    cases = [(x, cpu_gemv.PLAIN, x), (x, cpu_gemv.Prologue(norm, eps), normed),
             (gate_up, cpu_gemv.Prologue(glu=True), swiglu)]
    for inputs, prologue, h in cases:
        written = layer.product(inputs, prologue)
        torch.testing.assert_close(written, h @ weight.T, atol=2e-5, rtol=1e-5)
        out = residual.clone()
        assert layer.product(inputs, prologue, out=out) is out
        torch.testing.assert_close(out, residual + h @ weight.T, atol=2e-5, rtol=1e-5)
        for threads in (2, 3):
            assert torch.equal(cpu_gemv.gemv(inputs, layer.kernel_weights(), prologue, threads=threads), written)
        alone = torch.cat([layer.product(inputs[m:m + 1], prologue) for m in range(rows)])
        assert torch.equal(alone, written)
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_gemv.dense(torch.randn(8, 40))
    with pytest.raises(ValueError, match="contiguous fp32"):
        cpu_gemv.dense(weight.t())


@needs_kernel
def test_int8_layers_hold_their_weights_once_in_the_kernels_layout():
    """An int8 layer on the fused kernel keeps only the packed weights; they unpack to the row quantization."""
    from akv_core.model.quantized import quantize_int8_rows

    weight = torch.randn(43, 96, generator=generator(50))
    layer, (q, scale) = Int8Linear(weight), quantize_int8_rows(weight)
    assert not hasattr(layer, "q") and torch.equal(cpu_gemv.unpack_q8(layer.kernel), q)
    assert torch.equal(layer.dequantize(), q.float() * scale[:, None])


@needs_kernel
def test_products_refuse_inputs_they_cannot_take():
    q = torch.zeros(8, 64, dtype=torch.int8)
    packed = cpu_gemv.pack_q8(q, torch.ones(8))
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_gemv.gemv(torch.zeros(1, 48), packed)
    with pytest.raises(ValueError, match=r"\[0\.\.16, K\]"):
        cpu_gemv.gemv(torch.zeros(17, 64), packed)
    with pytest.raises(ValueError, match="64"):
        cpu_gemv.gemv(torch.zeros(1, 96), packed)
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_gemv.pack_q8(torch.zeros(8, 48, dtype=torch.int8), torch.ones(8))
    with pytest.raises(ValueError, match="scale"):
        cpu_gemv.pack_q4(torch.zeros(8, 64, dtype=torch.uint8), torch.ones(8, 3), torch.ones(8, 2))
    assert cpu_gemv.gemv(torch.zeros(0, 64), packed).shape == (0, 8)   # a pass without logits


@needs_kernel
@pytest.mark.parametrize(("counts", "heads", "kv_heads", "d", "rotary"),
                         [((5, 3), 6, 2, 16, 8), ((1, 8, 17, 40, 9), 9, 3, 64, 64), ((0, 23, 12), 4, 4, 24, 24)])
def test_decode_attention_rotates_writes_and_attends_over_the_listed_slots(counts, heads, kv_heads, d, rotary):
    """Sequences with different visible slots (none at all, fewer and more than a vector of 8 scores;
    grouped-query heads, partial rotary dims, a head size that is not a multiple of 16) against torch's
    RoPE and SDPA over the gathered slots; each new K/V lands in its own slot and is attended to."""
    rows, num_slots = len(counts), 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=generator(8))
    angles = torch.rand(rows, rotary // 2, generator=generator(9)) * 6
    cos, signed_sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((-angles.sin(), angles.sin()), -1)
    k_pool, v_pool = (torch.randn(num_slots, kv_heads, d, generator=generator(s)) * 2 for s in (10, 11))
    out_slots = torch.arange(num_slots - rows, num_slots)
    order = torch.randperm(num_slots - rows, generator=generator(12))
    seen = [torch.cat((order[:count - 1], out_slots[m:m + 1])) if count else order[:0] for m, count in enumerate(counts)]

    def rotated(heads_: torch.Tensor, m: int) -> torch.Tensor:
        rot = heads_[..., :rotary]
        rot = rot * cos[m] + rot.roll(rotary // 2, -1) * signed_sin[m]
        return torch.cat((rot, heads_[..., rotary:]), -1)

    k_expected, v_expected, expected, weights = k_pool.clone(), v_pool.clone(), [], []
    for m in range(rows):
        row = qkv[m].view(heads + 2 * kv_heads, d)
        k_expected[out_slots[m]], v_expected[out_slots[m]] = rotated(row[heads:heads + kv_heads], m), row[heads + kv_heads:]
    for m in range(rows):
        q = rotated(qkv[m].view(-1, d)[:heads], m)
        keys, values = k_expected[seen[m]].transpose(0, 1), v_expected[seen[m]].transpose(0, 1)
        keys_per_head = keys.repeat_interleave(heads // kv_heads, 0)
        weights.append(torch.softmax((q[:, None] @ keys_per_head.transpose(1, 2))[:, 0] * 0.3, -1).sum(0))
        if not counts[m]:   # nothing visible: the kernel's output is zero
            expected.append(torch.zeros(heads * d))
            continue
        expected.append(F.scaled_dot_product_attention(q[:, None], keys, values, scale=0.3, enable_gqa=True).reshape(-1))
    offsets, slots = torch.tensor([0, *counts]).cumsum(0), torch.cat(seen)
    mass = cpu_gemv.attention_mass_buffer(heads, slots)
    mass[:] = 1.0   # the weights are added to what the buffer holds
    got = cpu_gemv.decode_attention(qkv, heads, kv_heads, cos, signed_sin, k_pool, v_pool, out_slots, slots, offsets,
                                    0.3, mass=mass)
    assert torch.allclose(got, torch.stack(expected), atol=1e-5)
    assert torch.allclose(k_pool, k_expected, atol=1e-6) and torch.equal(v_pool, v_expected)
    for m, row_weights in enumerate(cpu_gemv.row_masses(mass, heads, offsets)):   # per slot, summed over heads
        assert torch.allclose(row_weights, weights[m] + heads, atol=1e-5)
    with pytest.raises(ValueError, match="mass must be contiguous fp32"):
        cpu_gemv.decode_attention(qkv, heads, kv_heads, cos, signed_sin, k_pool, v_pool, out_slots, slots, offsets,
                                  0.3, mass=mass[1:])


def test_the_switch_keeps_torchs_kernels(monkeypatch):
    monkeypatch.setenv(cpu_gemv.SWITCH, "off")
    assert not cpu_gemv.available() and cpu_gemv.why_unavailable() == f"{cpu_gemv.SWITCH}=off"
    layer = Int4Linear(Int4Groups.quantize(torch.randn(32, 64, generator=generator(12))))
    assert not layer.fused and hasattr(layer, "scale_zeros")   # torch's packing, made only for its kernel
    assert layer(torch.randn(1, 64)).shape == (1, 32)


@needs_kernel
@pytest.mark.model
def test_the_models_fused_decode_step_agrees_with_torchs_path():
    """A decode step of two sequences (different visible slots) through the fused kernels and through the
    generic path (torch's int4 kernel, bf16 activations): the same K/V slots written, logits close; on 2
    and 3 threads the fused step is bit-identical to 1 thread."""
    from akv_core.model.batch import ForwardBatch, SeqAttention
    from test_model_support import smollm2

    model = smollm2("int4")
    assert model.fused_decode
    prompt, slots = torch.randint(100, 40000, (24,), generator=generator(13)), torch.arange(32)
    kv = model.new_kv_buffers(32)
    model.forward(ForwardBatch(prompt, slots[:24], slots[:24], [SeqAttention(0, 24, slots[:24])], torch.tensor([23])), kv)
    step = ForwardBatch(torch.tensor([5, 77]), torch.tensor([24, 10]), torch.tensor([24, 25]),
                        [SeqAttention(0, 1, slots[:25]), SeqAttention(1, 1, torch.cat([slots[:10], slots[25:26]]))],
                        torch.tensor([0, 1]))
    fused = model.forward(step, kv)
    written = [kv.k[layer][24:26].clone() for layer in (0, 29)]
    previous = torch.get_num_threads()
    try:
        for threads in (2, 3):   # the kernels follow torch's thread count; the step again, split across threads
            torch.set_num_threads(threads)
            assert torch.equal(model.forward(step, kv), fused) and cpu_gemv.last_threads() == threads
            assert all(torch.equal(keys, kv.k[layer][24:26]) for layer, keys in zip((0, 29), written))
    finally:
        torch.set_num_threads(previous)
    try:
        model.fused_decode = False
        generic = model.forward(step, kv)
    finally:
        model.fused_decode = True
    kl = F.kl_div(fused.log_softmax(-1), generic.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    assert (kl < 0.01).all(), kl
    for layer, keys in zip((0, 29), written):
        assert (keys - kv.k[layer][24:26]).abs().max() < 0.05 * keys.abs().max()


@needs_kernel
@pytest.mark.model
def test_a_decode_step_of_more_sequences_than_one_call_takes_runs_fused_in_several():
    """18 sequences (more than the kernels' 16 rows) decode fused in two calls: logits and written K/V bit for
    bit those of the same rows decoded as two batches of 9 (a row's result never depends on its neighbours)."""
    from akv_core.model.batch import ForwardBatch, SeqAttention
    from test_model_support import smollm2

    model, rows = smollm2("int4"), 18
    kv = model.new_kv_buffers(rows * 5)
    for layer in range(model.config.num_layers):
        kv.k[layer].normal_(generator=generator(40))
        kv.v[layer].normal_(generator=generator(41))
    slots = torch.arange(rows * 5).view(rows, 5)
    tokens = torch.randint(100, 40000, (rows,), generator=generator(42))

    def step(lo: int, hi: int) -> ForwardBatch:
        return ForwardBatch(tokens[lo:hi], torch.full((hi - lo,), 4), slots[lo:hi, -1].contiguous(),
                            [SeqAttention(m, 1, slots[lo + m]) for m in range(hi - lo)], torch.arange(hi - lo))

    assert model.decodes_fused(step(0, rows), kv)
    split_kv = [(k.clone(), v.clone()) for k, v in zip(kv.k, kv.v)]
    whole = model.forward(step(0, rows), kv)
    written = [kv.k[layer].clone() for layer in (0, 29)]
    for layer, (k, v) in enumerate(split_kv):
        kv.k[layer].copy_(k)
        kv.v[layer].copy_(v)
    halves = torch.cat([model.forward(step(0, 9), kv), model.forward(step(9, rows), kv)])
    assert torch.equal(whole, halves)
    assert all(torch.equal(keys, kv.k[layer]) for layer, keys in zip((0, 29), written))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_products_are_bit_identical_on_any_thread_count(rows: int):
    """Each output column is computed whole by one thread: 2 and 3 threads (more than this machine's cores)
    give exactly the 1-thread result, for an odd column count, with prologues and accumulation."""
    n, k = 203, 192
    weight = torch.randn(n, k, generator=generator(20)) * 0.05
    x, gate_up = torch.randn(rows, k, generator=generator(21)), torch.randn(rows, 2 * k, generator=generator(22))
    norm, residual = torch.rand(k, generator=generator(23)) + 0.5, torch.randn(rows, n, generator=generator(24))
    cases = [(x, cpu_gemv.PLAIN), (x, cpu_gemv.Prologue(norm, 1e-5)), (gate_up, cpu_gemv.Prologue(glu=True))]
    for layer in (Int4Linear(Int4Groups.quantize(weight)), Int8Linear(weight)):
        for inputs, prologue in cases:
            results = []
            for threads in (1, 2, 3):
                out = residual.clone()
                cpu_gemv.gemv(inputs, layer.kernel, prologue, out, threads)
                assert cpu_gemv.last_threads() == threads   # the pool really ran the call on that many threads
                results.append(out)
            assert all(torch.equal(results[0], other) for other in results[1:])


@needs_kernel
def test_decode_attention_is_bit_identical_on_any_thread_count():
    heads, kv_heads, d, rotary, num_slots = 9, 3, 32, 16, 50
    qkv = torch.randn(3, (heads + 2 * kv_heads) * d, generator=generator(25))
    cos, signed_sin = torch.rand(3, rotary, generator=generator(26)), torch.rand(3, rotary, generator=generator(27))
    pools = [torch.randn(num_slots, kv_heads, d, generator=generator(s)) for s in (28, 29)]
    slots, offsets = torch.tensor([0, 3, 4, 47, 1, 2, 48, 5, 6, 7, 49]), torch.tensor([0, 4, 7, 11])
    results = []
    for threads in (1, 2, 3):
        k_pool, v_pool = (p.clone() for p in pools)
        out = cpu_gemv.decode_attention(qkv.clone(), heads, kv_heads, cos, signed_sin, k_pool, v_pool,
                                        torch.tensor([47, 48, 49]), slots, offsets, 0.2, threads)
        results.append((out, k_pool, v_pool))
    assert all(torch.equal(a, b) for other in results[1:] for a, b in zip(results[0], other))


@needs_kernel
def test_concurrent_callers_share_the_pool_safely():
    """Python threads calling at once (ctypes releases the GIL): one call holds the pool, the others run on
    their own thread meanwhile; every result is the serial one."""
    import threading

    layer = Int4Linear(Int4Groups.quantize(torch.randn(300, 256, generator=generator(30))))
    inputs = [torch.randn(2, 256, generator=generator(31 + i)) for i in range(4)]
    expected = [layer.product(x) for x in inputs]
    failures: list[int] = []

    def call(i: int) -> None:
        for _ in range(40):
            got = cpu_gemv.gemv(inputs[i], layer.kernel, threads=2)
            if not torch.equal(got, expected[i]):
                failures.append(i)

    callers = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert not failures


@needs_kernel
def test_a_forked_child_starts_its_own_workers():
    """The parent's workers do not exist in a forked child: its threaded calls must start new ones, not wait; nor
    do the parent's OpenMP threads, on which the prefill attention ran: the child runs it on its own workers. (The
    child compares bytes in numpy: torch's own parallel operators wait for those threads in a forked child.)"""
    import os
    import time

    layer = Int8Linear(torch.randn(64, 96, generator=generator(35)))
    x = torch.randn(1, 96, generator=generator(36))
    q, keys = torch.randn(100, 9, 64, generator=generator(37)), torch.randn(100, 3, 64, generator=generator(38))
    expected = cpu_gemv.gemv(x, layer.kernel, threads=2)   # the parent's pool has started
    attention = cpu_gemv.causal_attention(q, keys, keys, 0.125, 2)   # and its OpenMP threads, where found
    child = os.fork()
    if child == 0:
        ok = torch.equal(cpu_gemv.gemv(x, layer.kernel, threads=2), expected)
        again = cpu_gemv.causal_attention(q, keys, keys, 0.125, 2)
        ok = ok and again.numpy().tobytes() == attention.numpy().tobytes()
        os._exit(0 if ok and cpu_gemv.last_threads() == 2 else 1)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(child, 9)
        os.waitpid(child, 0)
    assert done[0] == child and os.waitstatus_to_exitcode(done[1]) == 0


def test_a_compiler_failure_is_reported_with_its_message(monkeypatch, tmp_path):
    """why_unavailable() names the compiler and quotes its first lines, so a broken toolchain is diagnosable."""
    fake = tmp_path / "broken-cc"
    fake.write_text("#!/bin/sh\necho 'broken-cc: error: unrecognized option -mavx2' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("AKV_KERNEL_CACHE", str(tmp_path / "kernels"))   # a fresh cache: the build is attempted
    if not getattr(torch.cpu, "_is_avx2_supported", lambda: False)():
        pytest.skip("the CPU has no AVX2: the compiler is never asked")
    cpu_gemv._loaded.cache_clear()
    try:
        reason = cpu_gemv.why_unavailable()
    finally:
        cpu_gemv._loaded.cache_clear()   # the real compiler again for the other tests
    assert reason is not None and str(fake) in reason and "unrecognized option -mavx2" in reason and "exit 1" in reason


@needs_kernel
def test_dense_products_of_a_few_rows_match_torch_and_do_not_depend_on_their_neighbours():
    """fp32 weights as loaded: every row count the kernel takes (rows run in pairs, columns in fours: full and
    partial ones), on 1 and 3 threads; a row's result is bit for bit the same alone, beside others and on any
    thread count."""
    n, k, most = 43, 96, cpu_gemv.max_rows()
    x, weight = torch.randn(most, k, generator=generator(50)), torch.randn(n, k, generator=generator(51))
    alone = torch.cat([cpu_gemv.dense_gemv(x[m:m + 1], weight) for m in range(most)])
    torch.testing.assert_close(alone, F.linear(x, weight), atol=1e-4, rtol=1e-5)
    for rows in range(1, most + 1):
        for threads in (1, 3):
            assert torch.equal(cpu_gemv.dense_gemv(x[:rows], weight, threads=threads), alone[:rows]), (rows, threads)
    exact_x, exact_w = torch.randint(-8, 9, (5, k), generator=generator(52)).float(), torch.randint(-8, 9, (n, k)).float()
    assert torch.equal(cpu_gemv.dense_gemv(exact_x, exact_w), (exact_x.double() @ exact_w.double().T).float())


@needs_kernel
def test_dense_products_refuse_what_they_cannot_take():
    weight = torch.randn(8, 64)
    for x, w, what in ((torch.randn(2, 60), torch.randn(8, 60), "multiple of 8"),
                       (torch.randn(cpu_gemv.max_rows() + 1, 64), weight, "rows"),
                       (torch.randn(2, 64), torch.randn(64, 8).T, "contiguous"),
                       (torch.randn(2, 32), weight, "K a multiple")):
        with pytest.raises(ValueError, match="dense_gemv"):
            cpu_gemv.dense_gemv(x, w)
    with pytest.raises(ValueError, match="fp32"):
        cpu_gemv.dense_gemv(torch.randn(2, 64).half(), weight)


@needs_kernel
@pytest.mark.model
def test_the_float32_models_decode_kernels_agree_with_torchs_operators():
    """float32 SmolLM2: a decode step of three sequences in one fused call (fp32 products, bit for bit the same
    on 1, 2 and 3 threads), through the dense product and attention kernels layer by layer, and through torch's
    operators alone (F.linear, one SDPA call per sequence): the same K/V written (up to rounding), logits
    within float32 rounding; a prompt pass never takes the kernels' attention."""
    from akv_core.model.batch import ForwardBatch, SeqAttention
    from akv_core.model.linear import Linear
    from test_model_support import smollm2

    model = smollm2()
    kv = model.new_kv_buffers(40)
    prompt, slots = torch.randint(100, 40000, (24,), generator=generator(60)), torch.arange(40)
    first = ForwardBatch(prompt, slots[:24], slots[:24], [SeqAttention(0, 24, slots[:24])], torch.tensor([23]))
    assert model._kernel_attention(first, kv, *model.rope.cos_sin(first.positions)) is None
    model.forward(first, kv)
    step = ForwardBatch(torch.tensor([5, 77, 901]), torch.tensor([24, 10, 3]), torch.tensor([24, 25, 26]),
                        [SeqAttention(0, 1, slots[:25]), SeqAttention(1, 1, torch.cat([slots[:10], slots[25:26]])),
                         SeqAttention(2, 1, torch.cat([slots[20:23], slots[26:27]]))], torch.tensor([0, 1, 2]))
    assert model._kernel_attention(step, kv, *model.rope.cos_sin(step.positions)) is not None
    assert model.decodes_fused(step, kv)   # fp32 weights as loaded join the one-call decode step
    fused = model.forward(step, kv)
    written = [kv.k[layer][24:27].clone() for layer in (0, 29)]
    previous = torch.get_num_threads()
    try:
        for threads in (2, 3):   # the one-call step split across threads: bit for bit the same
            torch.set_num_threads(threads)
            assert torch.equal(model.forward(step, kv), fused) and cpu_gemv.last_threads() == threads
    finally:
        torch.set_num_threads(previous)
    projections = [p for w in model.layers for p in (w.qkv, w.o, w.gate_up, w.down)] + [model.lm_head]
    assert all(isinstance(p, Linear) and p.dense_rows and p.fused for p in projections)
    try:
        model.fused_decode = False   # the dense products and the attention kernel, layer by layer
        kernels = model.forward(step, kv)
        model._attention_kernel = False
        for p in projections:
            p.dense_rows = False
        torch_path = model.forward(step, kv)
    finally:
        model.fused_decode = model._attention_kernel = True
        for p in projections:
            p.dense_rows = True
    for path in (kernels, torch_path):
        torch.testing.assert_close(fused, path, atol=2e-3, rtol=0)
        assert (fused.argmax(-1) == path.argmax(-1)).all()
    for layer, keys in zip((0, 29), written):
        torch.testing.assert_close(keys, kv.k[layer][24:27], atol=1e-3, rtol=0)


def causal_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """A prompt's causal attention in float64 (query i sees keys 0 .. K - n + i), the query heads of a key head
    consecutive: [n, H, D]."""
    n, total, group = q.shape[0], keys.shape[0], q.shape[1] // keys.shape[1]
    k, v = (t.double().repeat_interleave(group, 1).transpose(0, 1) for t in (keys, values))
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * scale
    visible = torch.ones(n, total, dtype=torch.bool).tril(total - n)
    return (torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v).transpose(0, 1)


@needs_kernel
@pytest.mark.parametrize(("new", "total", "heads", "kv_heads", "d"), [
    (1, 1, 9, 3, 64), (5, 5, 9, 3, 64), (33, 33, 9, 3, 64), (100, 250, 9, 3, 64), (97, 97, 4, 4, 32),
    (130, 300, 8, 2, 128), (70, 130, 2, 1, 16), (64, 64, 3, 3, 256)])
def test_causal_attention_matches_a_float64_reference(new: int, total: int, heads: int, kv_heads: int, d: int):
    """A fresh prompt (K = n) and new tokens after a prefix; grouped, multi-head and single-key-head shapes;
    query counts that fill, split and leave part of the kernel's blocks of 32 queries and 64 keys; D 16-256."""
    scale = d ** -0.5
    q = torch.randn(new, heads, d, generator=generator(30)) * 2
    keys, values = (torch.randn(total, kv_heads, d, generator=generator(s)) for s in (31, 32))
    got = cpu_gemv.causal_attention(q, keys, values, scale)
    assert got.shape == (new, heads, d) and got.dtype == torch.float32
    assert (got.double() - causal_reference(q, keys, values, scale)).abs().max() < 1e-5


@needs_kernel
def test_causal_attention_reads_strided_rows_and_is_bit_identical_on_any_thread_count():
    """q, keys and values as views of one [n, (H + 2 Hk) D] projection output (a row stride of 15 heads), as a
    fresh prompt hands them over: the result equals the contiguous copies' on 1, 2 and 3 threads."""
    n, heads, kv_heads, d = 150, 9, 3, 64
    qkv = torch.randn(n, heads + 2 * kv_heads, d, generator=generator(33))
    q, keys, values = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    expected = causal_reference(q, keys, values, 0.125)
    results = [cpu_gemv.causal_attention(q, keys, values, 0.125, threads) for threads in (1, 2, 3)]
    results.append(cpu_gemv.causal_attention(q.contiguous(), keys.contiguous(), values.contiguous(), 0.125, 1))
    assert all(torch.equal(results[0], other) for other in results[1:])
    assert (results[0].double() - expected).abs().max() < 1e-5


@needs_kernel
@pytest.mark.parametrize(("q", "keys", "values", "message"), [
    ((8, 9, 64), (4, 3, 64), (4, 3, 64), "expected 1 <= n <= K"),
    ((8, 9, 24), (8, 3, 24), (8, 3, 24), "D a multiple of 16 up to 256"),
    ((8, 9, 64), (8, 3, 64), (9, 3, 64), "matching key and value shapes"),
    ((8, 8, 64), (8, 3, 64), (8, 3, 64), r"heads \(8\) must be a positive multiple of kv_heads \(3\)"),
    ((8, 9), (8, 3, 64), (8, 3, 64), r"q \[n, H, D\] and keys \[K, Hkv, D\]")])
def test_causal_attention_refuses_shapes_it_cannot_take(q, keys, values, message: str):
    with pytest.raises(ValueError, match=message):
        cpu_gemv.causal_attention(torch.zeros(q), torch.zeros(keys), torch.zeros(values), 0.125)


@needs_kernel
@pytest.mark.skipif(not torch.backends.openmp.is_available(), reason="this torch was built without OpenMP")
def test_the_prefill_attention_runs_on_torchs_openmp_threads_with_the_pools_results():
    """torch's OpenMP runtime is found among the loaded libraries; the attention run on its threads (the default)
    equals the run on the kernel's own pool bit for bit, on 2 and 3 threads (the threads' count is reported),
    and after torch's own parallel operators, whose threads are the ones reused."""
    runtime = cpu_gemv.openmp_runtime()
    assert runtime is not None and runtime.startswith(("libgomp", "libomp", "libiomp")), runtime
    n, heads, kv_heads, d = 300, 9, 3, 64
    q = torch.randn(n, heads, d, generator=generator(40))
    keys, values = (torch.randn(n + 50, kv_heads, d, generator=generator(s)) for s in (41, 42))
    with cpu_gemv.own_pool():
        pooled = cpu_gemv.causal_attention(q, keys, values, 0.125, 2)
    for threads in (2, 3):
        torch.randn(512, 512).exp_()   # torch's threads busy just before
        assert torch.equal(cpu_gemv.causal_attention(q, keys, values, 0.125, threads), pooled)
        assert cpu_gemv.last_threads() == threads
    assert (pooled.double() - causal_reference(q, keys, values, 0.125)).abs().max() < 1e-5


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return weight.double() * x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 63, 64, 300])
def test_rows_prologue_norms_and_gates_rows_as_the_model_does(rows: int):
    """RMSNorm of [M, K] rows, SiLU(gate) * up of [M, 2K] rows, and both, against float64; one thread and two give
    the same bits (each row computed whole by one thread), row counts on both sides of the threaded size."""
    k, eps = 96, 1e-5
    x, gate_up = torch.randn(rows, k, generator=generator(50)) * 3, torch.randn(rows, 2 * k, generator=generator(51))
    weight = torch.rand(k, generator=generator(52)) + 0.5
    gate, up = gate_up.double().chunk(2, dim=-1)
    glu = F.silu(gate) * up
    cases = [(x, dict(norm=weight, eps=eps), rms_norm_reference(x, weight, eps)),
             (gate_up, dict(glu=True), glu), (gate_up, dict(glu=True, norm=weight, eps=eps),
                                              rms_norm_reference(glu, weight, eps))]
    for source, options, expected in cases:
        one, two = (cpu_gemv.rows_prologue(source, threads=threads, **options) for threads in (1, 2))
        assert one.shape == (rows, k) and one.is_contiguous() and torch.equal(one, two)
        assert ((one.double() - expected).abs() / (expected.abs() + 1e-3)).max() < 1e-5


@needs_kernel
@pytest.mark.parametrize(("shape", "options", "message"), [
    ((4, 24), {}, "K a multiple of 16"), ((4, 40), {"glu": True}, "K a multiple of 16"),
    ((0, 32), {}, "at least one row"), ((32,), {}, r"x must be a CPU tensor \[M, K\]"),
    ((4, 32), {"norm": torch.ones(16)}, r"norm must have shape \(32,\)")])
def test_rows_prologue_refuses_what_it_cannot_take(shape, options, message: str):
    with pytest.raises(ValueError, match=message):
        cpu_gemv.rows_prologue(torch.zeros(shape), **options)


@needs_kernel
@pytest.mark.parametrize(("rows", "rotary"), [(5, 64), (100, 64), (70, 32)])
def test_rotate_and_store_rotates_q_and_k_in_place_and_writes_the_rows_kv_to_their_slots(rows: int, rotary: int):
    """q and k heads rotated by cos / signed sin over their first `rotary` dims (the rest as they were), v as it
    was, each row's K/V in its pool slot and no other slot touched; 1 and 2 threads alike."""
    heads, kv_heads, d, half = 9, 3, 64, rotary // 2
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=generator(60))
    cos, sin = (torch.randn(rows, rotary, generator=generator(s)) for s in (61, 62))
    slots = torch.randperm(rows + 20, generator=generator(63))[:rows]
    heads_of = qkv.view(rows, heads + 2 * kv_heads, d).clone()
    part = heads_of[:, :heads + kv_heads, :rotary]
    heads_of[:, :heads + kv_heads, :rotary] = part * cos[:, None] + part.roll(half, dims=-1) * sin[:, None]
    results = []
    for threads in (1, 2):
        rotated, k_pool, v_pool = qkv.clone(), torch.full((rows + 20, kv_heads, d), 7.0), torch.full(
            (rows + 20, kv_heads, d), 7.0)
        cpu_gemv.rotate_and_store(rotated, heads, kv_heads, cos, sin, k_pool, v_pool, slots, threads)
        torch.testing.assert_close(rotated.view_as(heads_of), heads_of, atol=1e-6, rtol=1e-6)
        assert torch.equal(k_pool[slots], rotated.view_as(heads_of)[:, heads:heads + kv_heads])
        assert torch.equal(v_pool[slots], qkv.view_as(heads_of)[:, heads + kv_heads:])
        untouched = torch.ones(rows + 20, dtype=torch.bool).index_fill_(0, slots, False)
        assert bool((k_pool[untouched] == 7.0).all()) and bool((v_pool[untouched] == 7.0).all())
        results.append((rotated, k_pool))
    assert all(torch.equal(a, b) for a, b in zip(*results))


@needs_kernel
@pytest.mark.parametrize(("out_slots", "message"), [
    (torch.tensor([0, 1, 30]), "outside the pool's 30 slots"), (torch.tensor([0, 1]), r"one slot per row \(3\)"),
    (torch.tensor([0.0, 1.0, 2.0]), "out_slots must be an integer CPU tensor")])
def test_rotate_and_store_refuses_slots_outside_the_pool(out_slots: torch.Tensor, message: str):
    qkv, cos = torch.zeros(3, 15 * 64), torch.zeros(3, 64)
    pools = [torch.zeros(30, 3, 64) for _ in range(2)]
    with pytest.raises(ValueError, match=message):
        cpu_gemv.rotate_and_store(qkv, 9, 3, cos, cos, *pools, out_slots)
