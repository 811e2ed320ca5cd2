"""netdsl: a declarative language and toolchain for training very deep networks."""
from netdsl.api import Network, load, loads
from netdsl.errors import NetdslError

__version__ = "0.1.0"
__all__ = ["Network", "NetdslError", "load", "loads"]
