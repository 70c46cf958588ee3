"""Named quantization recipes: YAML units and presets, in ModelOpt's ``quant_cfg`` syntax.

A recipe file is a YAML mapping with up to three keys:

- ``description``: one line for people;
- ``units``: names of other recipes whose entries come first, in this order (presets are
  built this way; a name resolves to a file next to this one, else a packaged recipe);
- ``quant_cfg``: a list of entries ``{quantizer_name: "*dispatch_quantizer", cfg: {...},
  enable: true}``. ``quantizer_name`` is an ``fnmatch`` wildcard on the quantizer's
  qualified name (``layers.3.experts.dispatch_quantizer``); ``cfg`` is a quantizer cfg
  (``moewire.quantizer.parse_cfg``: ``num_bits`` as a list ``[4, 3]``, ``block_sizes``,
  ``axis``, ``constant_amax``, ``enable``, or moewire's ``format``); an entry needs
  ``cfg``, ``enable`` or both.

Matching follows ModelOpt's ``quant_cfg`` order: every matching entry is applied in turn, so
later entries win. An entry with a ``cfg`` replaces the quantizer's attributes (and
enables it unless ``enable: false``); an entry with only ``enable`` switches it on or off
and keeps the attributes set before.

Every cfg is validated when the file is loaded; an error names the file and line.

The package: ``recipe`` (:class:`Recipe`, its entries and their check), ``loading`` (the
YAML files, packaged or by path), ``modelopt`` (a recipe in ModelOpt's spelling).
"""

from moewire.recipes.loading import load, names
from moewire.recipes.modelopt import to_modelopt
from moewire.recipes.recipe import Recipe, RecipeEntry

__all__ = ["Recipe", "RecipeEntry", "load", "names", "to_modelopt"]
