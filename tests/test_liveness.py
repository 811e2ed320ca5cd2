"""Static liveness predicts the executor's measured peak exactly, on real examples."""
import pytest
from _examples import example_feeds, load

from netdsl.memory.liveness import analyse
from netdsl.passes.autodiff import autodiff
from netdsl.passes.optimizer import add_optimizer
from netdsl.runtime.executor import Executor


@pytest.mark.parametrize("example,batch", [("digits-cnn", 8), ("resnet20-cifar", 2),
                                           ("transformer-tiny", 2)])
def test_predicted_peak_is_measured_peak(example, batch):
    net = load(f"{example}.net")
    g = add_optimizer(autodiff(net.lower(batch)), "sgd", lr=0.01, momentum=0.9)
    roles = ("loss", "output", "updates")
    predicted = analyse(g, roles)
    ex = Executor(g, "numpy")
    ex.run(example_feeds(g), roles=roles)
    assert ex.peak_bytes == predicted.peak_bytes
    # freeing matters: the peak is well below keeping every value of the step
    everything = predicted.state_bytes + sum(
        n.type.nbytes() for n in g.nodes if n.op not in ("param", "buffer"))
    assert predicted.peak_bytes < everything
