"""multi_block_step: many tensors in grouped launches equal block_step on each tensor."""

from __future__ import annotations

import pytest
import torch
from kernels_inputs import (
    assert_bitwise,
    assert_within_one_ulp,
    clone_state,
    make_codebook,
    random_state,
    with_zero_gradients,
)

from gefen_kernels.ops.block_step import block_step_reference, block_step_triton
from gefen_kernels.ops.multi_block_step import (
    multi_block_step,
    multi_block_step_reference,
    multi_block_step_triton,
)

# (num_blocks, period, param dtype, grad dtype): mixed dtypes and period classes, periods
# sharing a power-of-two class (5, 6, 7 -> 8), a long period (separate launch) and numel 1.
SHAPES = [(10, 7, torch.bfloat16, torch.bfloat16), (20, 6, torch.bfloat16, torch.bfloat16),
          (9, 5, torch.bfloat16, torch.bfloat16), (3, 1024, torch.float32, torch.float32),
          (4097, 1, torch.bfloat16, torch.bfloat16), (2, 5000, torch.float16, torch.float32),
          (5, 64, torch.bfloat16, torch.float32), (1, 1, torch.float32, torch.float32),
          (0, 8, torch.float32, torch.float32)]


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(dev: str, shapes=SHAPES):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(b * p, generator=gen).to(dt).to(dev) for b, p, dt, _ in shapes]
    grads = [with_zero_gradients(torch.randn(b * p, generator=gen).to(gt).to(dev), p, b * p)
             for b, p, _, gt in shapes]
    states = [random_state(b, p, seed=i, device=dev) for i, (b, p, _, _) in enumerate(shapes)]
    hyper = torch.tensor([[1e-3 * (i + 1), 1.5 + i, 2.0, 1 - 1e-4 * i]
                          for i in range(len(shapes))], device=dev)
    seeds = (torch.arange(len(shapes), device=dev) * 7919 - 3).to(torch.int64)
    return params, grads, states, hyper, seeds


def _lists(states):
    return ([s["codes"] for s in states], [s["scale"] for s in states],
            [s["exp_avg_sq"] for s in states])


@pytest.mark.parametrize("stochastic,maximize", [(False, False), (True, True)])
def test_triton_equals_per_tensor_kernel_and_reference(stochastic: bool, maximize: bool) -> None:
    dev = _device()
    cb = make_codebook(1).to(dev)
    params, grads, states, hyper, seeds = _inputs(dev)
    kw = dict(beta1=0.9, beta2=0.999, eps=1e-8, maximize=maximize, stochastic_round=stochastic)
    multi_p, multi_s = [p.clone() for p in params], [clone_state(s) for s in states]
    multi_block_step_triton(multi_p, grads, *_lists(multi_s), cb, hyper=hyper, seeds=seeds, **kw)
    ref_p, ref_s = [p.clone() for p in params], [clone_state(s) for s in states]
    multi_block_step_reference(ref_p, grads, *_lists(ref_s), cb, hyper=hyper, seeds=seeds, **kw)
    for i in range(len(params)):
        one_p, one_s = params[i].clone(), clone_state(states[i])
        block_step_triton(one_p, grads[i], one_s["codes"], one_s["scale"], one_s["exp_avg_sq"],
                          cb, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, bc1_recip=0.0,
                          bc2_rsqrt=0.0, decay=1.0, maximize=maximize,
                          stochastic_round=stochastic, hyper=hyper[i],
                          seed_tensor=seeds[i:i + 1])
        # Same kernel body, same data: bit-identical to the one-tensor launch.
        assert_bitwise(multi_p[i], one_p, f"param {i}")
        for key in one_s:
            assert_bitwise(multi_s[i][key], one_s[key], f"{key} {i}")
        # And the usual kernel-vs-reference rule.
        assert_bitwise(multi_s[i]["codes"], ref_s[i]["codes"], f"codes {i} vs reference")
        assert_bitwise(multi_s[i]["scale"], ref_s[i]["scale"], f"scale {i} vs reference")
        torch.testing.assert_close(multi_s[i]["exp_avg_sq"], ref_s[i]["exp_avg_sq"], rtol=4e-7,
                                   atol=0)
        assert_within_one_ulp(multi_p[i], ref_p[i], f"param {i}", before=params[i])


def test_second_call_reuses_tables_and_matches() -> None:
    dev = _device()
    cb = make_codebook(2).to(dev)
    params, grads, states, hyper, seeds = _inputs(dev)
    a_p, a_s = [p.clone() for p in params], [clone_state(s) for s in states]
    for _ in range(2):
        multi_block_step_triton(a_p, grads, *_lists(a_s), cb, beta1=0.9, beta2=0.999, eps=1e-8,
                                hyper=hyper, seeds=seeds)
    b_p, b_s = [p.clone() for p in params], [clone_state(s) for s in states]
    for _ in range(2):
        for i in range(len(params)):
            block_step_triton(b_p[i], grads[i], b_s[i]["codes"], b_s[i]["scale"],
                              b_s[i]["exp_avg_sq"], cb, lr=0.0, beta1=0.9, beta2=0.999,
                              eps=1e-8, bc1_recip=0.0, bc2_rsqrt=0.0, decay=1.0,
                              hyper=hyper[i], seed_tensor=seeds[i:i + 1])
    for i in range(len(params)):
        assert_bitwise(a_p[i], b_p[i], f"param {i}")


def test_public_op_on_cpu_and_errors() -> None:
    cb = make_codebook(3)
    params, grads, states, hyper, seeds = _inputs("cpu", SHAPES[:3])
    a_p, a_s = [p.clone() for p in params], [clone_state(s) for s in states]
    multi_block_step(a_p, grads, *_lists(a_s), cb, beta1=0.9, beta2=0.999, eps=1e-8,
                     hyper=hyper, seeds=seeds)
    for i in range(3):
        one_p, one_s = params[i].clone(), clone_state(states[i])
        block_step_reference(one_p, grads[i], one_s["codes"], one_s["scale"],
                             one_s["exp_avg_sq"], cb, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8,
                             bc1_recip=0.0, bc2_rsqrt=0.0, decay=1.0, hyper=hyper[i],
                             seed_tensor=seeds[i:i + 1])
        assert torch.equal(a_p[i], one_p)
    codes, scales, sqs = _lists(states)
    with pytest.raises(ValueError, match="grads has 2 tensors"):
        multi_block_step(params, grads[:2], codes, scales, sqs, cb, beta1=0.9, beta2=0.999,
                         eps=1e-8, hyper=hyper, seeds=seeds)
    with pytest.raises(ValueError, match=r"hyper must be a contiguous fp32 tensor \[3, 4\]"):
        multi_block_step(params, grads, codes, scales, sqs, cb, beta1=0.9, beta2=0.999,
                         eps=1e-8, hyper=hyper[:2], seeds=seeds)
    with pytest.raises(ValueError, match="codes shape"):
        multi_block_step(params, grads, [codes[1], codes[0], codes[2]], scales, sqs, cb,
                         beta1=0.9, beta2=0.999, eps=1e-8, hyper=hyper, seeds=seeds)
    multi_block_step([], [], [], [], [], cb, beta1=0.9, beta2=0.999, eps=1e-8,
                     hyper=torch.zeros(0, 4), seeds=torch.zeros(0, dtype=torch.int64))


@pytest.mark.gpu
def test_gpt2_shaped_list_and_cuda_graph_gpu() -> None:
    """148 tensors shaped like GPT-2 small's, grouped launches, then captured and replayed."""
    shapes = [(50257, 768), (1024, 768)]
    for _ in range(12):
        shapes += [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,), (768,), (768,),
                   (768, 3072), (3072,), (3072, 768), (768,)]
    shapes += [(768,), (768,)]
    periods = [s[-1] if len(s) == 2 else min(s[0], 768) for s in shapes]
    cb = make_codebook(4).cuda()
    params = [torch.randn(s, device="cuda").to(torch.bfloat16).view(-1) for s in shapes]
    grads = [torch.randn_like(p) for p in params]
    states = [random_state(p.numel() // per, per, seed=i, device="cuda")
              for i, (p, per) in enumerate(zip(params, periods))]
    n = len(params)
    hyper = torch.tensor([[1e-3, 1.5, 2.0, 0.9999]] * n, device="cuda")
    seeds = torch.arange(n, device="cuda", dtype=torch.int64)
    kw = dict(beta1=0.9, beta2=0.999, eps=1e-8, stochastic_round=True, hyper=hyper,
              seeds=seeds)
    ref_p, ref_s = [p.clone() for p in params], [clone_state(s) for s in states]
    multi_block_step_reference(ref_p, grads, *_lists(ref_s), cb, **kw)
    live_p, live_s = [p.clone() for p in params], [clone_state(s) for s in states]
    multi_block_step(live_p, grads, *_lists(live_s), cb, **kw)  # eager: builds the tables
    for i in range(n):
        assert_bitwise(live_s[i]["codes"], ref_s[i]["codes"], f"codes {i}")
        assert_within_one_ulp(live_p[i], ref_p[i], f"param {i}", before=params[i])
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        multi_block_step(live_p, grads, *_lists(live_s), cb, **kw)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        multi_block_step(live_p, grads, *_lists(live_s), cb, **kw)
    eager_p, eager_s = [p.clone() for p in live_p], [clone_state(s) for s in live_s]
    seeds.add_(1000)
    graph.replay()
    multi_block_step_triton(eager_p, grads, *_lists(eager_s), cb, **kw)
    torch.cuda.synchronize()
    for i in range(n):
        assert_bitwise(live_p[i], eager_p[i], f"replayed param {i}")
        assert_bitwise(live_s[i]["codes"], eager_s[i]["codes"], f"replayed codes {i}")
