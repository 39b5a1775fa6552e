"""Model families. Importing this package registers every built-in family in `MODELS`."""

from hetfl.models import plain as _plain  # noqa: F401  (registers the plain models)
from hetfl.models.base import MODELS, ModelBuilder, PlainFamily

__all__ = ["MODELS", "ModelBuilder", "PlainFamily"]
