"""Model families. Importing this package registers every built-in model: the plain ones in
`MODELS`, the scalable (width- and depth-sliced) ones in `ARCHITECTURES` (MobileNetV2's from
`hetfl.models.mobilenet`, EfficientNetV2's from `hetfl.models.efficientnet`, the
Transformers' from `hetfl.models.transformer`, the detector from `hetfl.models.ssd`),
FLANC's composed ones in `COMPOSED`, the split ones (DTFL's ResNet in modules) in
`SPLIT`."""

from hetfl.models import efficientnet as _efficientnet  # noqa: F401  (registers efficientnetv2-*)
from hetfl.models import mobilenet as _mobilenet  # noqa: F401  (registers mobilenetv2)
from hetfl.models import plain as _plain  # noqa: F401  (registers the plain models)
from hetfl.models import ssd as _ssd  # noqa: F401  (registers ssd-stage-cnn)
from hetfl.models import transformer as _transformer  # noqa: F401  (registers the Transformers)
from hetfl.models.base import MODELS, ModelBuilder, PlainFamily
from hetfl.models.factory import is_composed, is_scalable, is_split, make_family, model_names
from hetfl.models.flanc import COMPOSED, ComposedFamily
from hetfl.models.resnet_cifar import SPLIT, CifarResNetFamily
from hetfl.models.scalable import ARCHITECTURES, ScalableFamily, SpecError

__all__ = [
    "ARCHITECTURES",
    "COMPOSED",
    "MODELS",
    "SPLIT",
    "CifarResNetFamily",
    "ComposedFamily",
    "ModelBuilder",
    "PlainFamily",
    "ScalableFamily",
    "SpecError",
    "is_composed",
    "is_scalable",
    "is_split",
    "make_family",
    "model_names",
]
