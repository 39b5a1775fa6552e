"""Federated methods. Importing this package registers every built-in method in `ALGORITHMS`."""

from hetfl.algorithms import dtfl as _dtfl  # noqa: F401
from hetfl.algorithms import fedalrc as _fedalrc  # noqa: F401
from hetfl.algorithms import fedavg as _fedavg  # noqa: F401
from hetfl.algorithms import fedfa as _fedfa  # noqa: F401
from hetfl.algorithms import fedgkt as _fedgkt  # noqa: F401
from hetfl.algorithms import fednova as _fednova  # noqa: F401
from hetfl.algorithms import fedopt as _fedopt  # noqa: F401
from hetfl.algorithms import fedprox as _fedprox  # noqa: F401
from hetfl.algorithms import fjord as _fjord  # noqa: F401
from hetfl.algorithms import flanc as _flanc  # noqa: F401
from hetfl.algorithms import flexifed as _flexifed  # noqa: F401
from hetfl.algorithms import flexlora as _flexlora  # noqa: F401
from hetfl.algorithms import flora as _flora  # noqa: F401
from hetfl.algorithms import heterofl as _heterofl  # noqa: F401
from hetfl.algorithms import hetlora as _hetlora  # noqa: F401
from hetfl.algorithms import local_only as _local_only  # noqa: F401
from hetfl.algorithms import nefl as _nefl  # noqa: F401
from hetfl.algorithms import scalablefl as _scalablefl  # noqa: F401
from hetfl.algorithms import splitfed as _splitfed  # noqa: F401
from hetfl.algorithms.parts.method_registry import ALGORITHMS, Algorithm, Options

__all__ = ["ALGORITHMS", "Algorithm", "Options"]
