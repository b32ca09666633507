"""Which scale element differs in the two failing GPU tests: with the table as built (printed
as "staged"; this codebook's is the bracket search, STEPS 3) and with STEPS -1 forced on that
table ("head": wrong codes, expected). Run from the snapshot's tree root's parent (call1b.sh).
Reformatted for the linter after the run; the statements are the ones that ran."""

import sys

import torch

sys.path.insert(0, "packages/gefen-kernels/tests/ops")
from kernels_inputs import clone_state, make_codebook, random_state  # noqa: E402
from test_block_step import _hyper  # noqa: E402

from gefen_kernels.ops import _search_table  # noqa: E402
from gefen_kernels.ops.block_step import block_step_reference, block_step_triton  # noqa: E402

dev = "cuda"
gen = torch.Generator().manual_seed(3)
grad = torch.randn(8 * 64, generator=gen)
grad[70] = float("nan")
grad[200] = float("inf")
grad[256:320] = 0.0
state = random_state(8, 64, seed=3)
state["scale"][4] = 0.0
param = torch.randn(8 * 64, generator=gen).to(dev)
grad = grad.to(dev)
state = {k: v.to(dev) for k, v in state.items()}
cb = make_codebook(3).to(dev)
hp = _hyper(3, 1e-3, 0.01)
ref_p, ref_s = param.clone(), clone_state(state)
block_step_reference(ref_p, grad, ref_s["codes"], ref_s["scale"], ref_s["exp_avg_sq"], cb, **hp)
table, steps = _search_table.kernel_table(cb)
print("steps", steps, "table", table.shape)
for name, st in (("staged", steps), ("head", -1)):
    _search_table._NEAREST_CACHE[cb] = (cb._version, table, st)
    tri_p, tri_s = param.clone(), clone_state(state)
    block_step_triton(tri_p, grad, tri_s["codes"], tri_s["scale"], tri_s["exp_avg_sq"], cb, **hp)
    a = tri_s["scale"].view(-1).view(torch.int32)
    b = ref_s["scale"].view(-1).view(torch.int32)
    d = (a != b).nonzero().flatten().tolist()
    bits = [(hex(a[i].item() & 0xFFFFFFFF), hex(b[i].item() & 0xFFFFFFFF)) for i in d]
    print(name, "differ at", d, bits, "codes equal", torch.equal(tri_s["codes"], ref_s["codes"]))
    print(name, "scale", tri_s["scale"].view(-1).tolist())
print("ref scale", ref_s["scale"].view(-1).tolist())
