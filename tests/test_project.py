"""One rank's part of a split step (`parallel.project`): what it reads and how long its
sends' messages are counted."""
from __future__ import annotations

from pathlib import Path

import pytest

import netdsl
from netdsl.memory.liveness import schedule
from netdsl.memory.plan import make_plan
from netdsl.parallel.project import project
from netdsl.parallel.split import SplitSpec, split_step

ROOT = Path(__file__).resolve().parents[1]
ROLES = ("loss", "output", "updates", "comm")


@pytest.fixture(scope="module")
def pipeline():
    net = netdsl.load(ROOT / "examples" / "digits-cnn.net")
    spec = SplitSpec(pipeline=2, microbatches=4, schedule="1f1b")
    return split_step(net.graph, 8, spec, {"kind": "sgd", "lr": 0.1})


@pytest.mark.parametrize("rank", [0, 1])
def test_a_send_is_counted_until_a_receive_that_proves_the_peer_has_it(pipeline, rank):
    """MPI keeps a sent message with the sender until the peer has received it, which no
    local node reads: the plan holds it to the first local receive of a message the peer
    sent after receiving it (the ranks run in graph order), or to the end of the step."""
    g, part = pipeline, project(pipeline, rank)
    pos = {n.name: k for k, n in enumerate(g.nodes)}
    order, frees, _ = schedule(part, ROLES)
    where = {n.name: k for k, n in enumerate(order)}
    freed_at = {name: k for k, names in enumerate(frees) for name in names}
    sends = [n for n in part.nodes if n.op == "send"]
    assert sends and all("held_to" in n.meta for n in sends)
    for s in sends:
        recv = next(n for n in g.nodes if n.op == "recv" and n.inputs == (s.name,))
        # the peer's sends to this rank after it received `s`, and where they land here
        later = [n for n in g.nodes if n.op == "recv" and n.device == rank
                 and g[n.inputs[0]].device == recv.device and pos[n.inputs[0]] > pos[recv.name]]
        to = s.meta["held_to"]
        if later:
            assert to == later[0].name and where[to] > where[s.name]
            assert freed_at[s.name] == where[to]
        else:
            assert to == "end" and freed_at[s.name] == len(order) - 1
    # without it the message was dropped as soon as it was sent
    for s in sends:
        del s.meta["held_to"]
    assert make_plan(part, ROLES).peak_bytes < make_plan(project(g, rank), ROLES).peak_bytes


def test_a_rank_is_fed_only_what_its_part_reads(pipeline):
    """The last stage of a pipeline reads the labels, not the images (the trainer no
    longer gathers a batch of images there that nothing reads)."""
    from netdsl.backends import get_backend
    from netdsl.runtime.executor import Executor
    fed = [Executor(project(pipeline, r), get_backend("numpy")).feed_names() for r in (0, 1)]
    assert "x" in fed[0] and "x" not in fed[1] and "y" in fed[1]


def test_the_planner_holds_the_sends_as_the_storage_plan_does(pipeline):
    """A step run over MPI is planned with its sends held (`mark_over_mpi`): the memory
    planner's simulation grows by what the storage plan the executor follows grows, on
    each device (the two differ by the 4-byte learning rate, counted on device 0 by the
    simulation alone, marks or not)."""
    from netdsl.ir.graph import Graph
    from netdsl.memory.plan import device_peaks
    from netdsl.memory.simulate import prepare, simulate
    from netdsl.parallel.project import mark_over_mpi
    roles = ("loss", "output", "updates")

    def peaks(g):
        return simulate(prepare(g, roles)).device_peaks, device_peaks(g, make_plan(g, roles))
    sim0, plan0 = peaks(pipeline)
    held = mark_over_mpi(Graph(pipeline.name, [n.copy() for n in pipeline.nodes],
                            {k: list(v) for k, v in pipeline.outputs.items()},
                            pipeline.batch, dict(pipeline.parallel), dict(pipeline.meta)))
    sim1, plan1 = peaks(held)
    assert plan1[0] > plan0[0] and all(plan1[d] >= plan0[d] for d in plan0)
    assert {d: sim1[d] - sim0[d] for d in sim0} == {d: plan1[d] - plan0[d] for d in plan0}
    assert all("held_to" not in n.meta for n in pipeline.nodes)  # (a copy was marked)
