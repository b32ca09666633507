"""The loop route's fused block step on CUDA against the PyTorch reference (diagnostic).

    PYTHONPATH=<packages>/src python scripts/loop_route_check.py [label]

Runs the inputs of gefen-kernels' ``test_triton_matches_reference_large_gpu`` for the loop
route (bf16, 2**26 elements, blocks of 8192 and 65536, one learned-like and one crowded
codebook) and prints, per case, whether the codes match bit for bit, how many parameters are
beyond the test's one-ulp tolerance (``bad``) or differ at all (``neq``), and the first
offending elements with their block's scale and second moment (reference, kernel). ``label``
only tags the lines; ``intcast`` also switches the kernels to the interpreter's integer bf16
rounding (set before the first compile). Written to chase a run-to-run race in that route
(docs/results/h200-2026-11-29-run4/README.md, section 4).
"""

from __future__ import annotations

import pathlib
import sys

import torch

sys.path.insert(
    0,
    str(
        pathlib.Path(__file__).resolve().parents[1] / "packages" / "gefen-kernels" / "tests" / "ops"
    ),
)

CASES = [(8192, 8192), (8192, 8191), (65536, 65536)]  # (period, make_codebook seed)


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "check"
    import gefen_kernels.ops._triton_helpers as helpers

    if label == "intcast":
        import triton.language as tl

        helpers.INTERPRETED = tl.constexpr(True)
    from kernels_inputs import clone_state, make_codebook, ulp
    from test_block_step import _hyper

    from gefen_kernels.ops._step_kernels import launch_step
    from gefen_kernels.ops.block_step import block_step_reference

    for period, seed in CASES:
        blocks = (1 << 26) // period
        gen = torch.Generator(device="cuda").manual_seed(period)
        param = torch.randn(blocks * period, device="cuda", generator=gen).to(torch.bfloat16)
        grad = torch.randn(blocks * period, device="cuda", generator=gen).to(torch.bfloat16)
        state = {
            "codes": torch.randint(
                0, 256, (blocks, period), device="cuda", dtype=torch.uint8, generator=gen
            ),
            "scale": torch.rand(blocks, 1, device="cuda", generator=gen) * 0.1,
            "exp_avg_sq": torch.rand(blocks, 1, device="cuda", generator=gen) * 1e-2,
        }
        cb = make_codebook(seed).cuda()
        hp = _hyper(3, 1e-3, 0.01)
        ref_p, ref_s = param.clone(), clone_state(state)
        block_step_reference(
            ref_p, grad, ref_s["codes"], ref_s["scale"], ref_s["exp_avg_sq"], cb, **hp
        )
        tri_p, tri_s = param.clone(), clone_state(state)
        launch_step(
            tri_p,
            grad,
            tri_s["codes"],
            tri_s["scale"],
            exp_avg_sq=tri_s["exp_avg_sq"],
            row=None,
            col=None,
            inv_rbar=None,
            ncols=1,
            codebook=cb,
            lr=hp["lr"],
            beta1=hp["beta1"],
            beta2=hp["beta2"],
            eps=hp["eps"],
            bc1_recip=hp["bc1_recip"],
            bc2=hp["bc2_rsqrt"],
            decay=hp["decay"],
            maximize=False,
            stochastic_round=False,
            seed=0,
            hyper=None,
            seed_tensor=None,
            route="loop",
        )
        a, b = tri_p.double(), ref_p.double()
        mag = torch.maximum(torch.maximum(a.abs(), b.abs()), param.double().abs())
        tol = torch.from_numpy(ulp(mag.cpu().numpy(), torch.bfloat16)).cuda()
        bad = (a - b).abs() > tol
        print(
            label,
            period,
            "cb",
            seed,
            "codes_eq",
            torch.equal(tri_s["codes"], ref_s["codes"]),
            "bad",
            int(bad.sum()),
            "neq",
            int((a != b).sum()),
        )
        for i in bad.nonzero().flatten()[:2].tolist():
            blk = i // period
            print(
                "   i",
                i,
                "p0",
                param[i].item(),
                "ref",
                ref_p[i].item(),
                "tri",
                tri_p[i].item(),
                "scale",
                ref_s["scale"][blk].item(),
                "v",
                ref_s["exp_avg_sq"][blk].item(),
                tri_s["exp_avg_sq"][blk].item(),
            )


if __name__ == "__main__":
    main()
