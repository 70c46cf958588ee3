"""Hosts: the frameworks moewire plugs into, one package each.

- ``vllm/``: vLLM's Mega-MoE experts. ``sites`` (one declarative entry per place vLLM keeps
  an experts class), ``bridge`` (vLLM's call-time DeepGEMM lookup and staging globals made
  globals moewire can name), ``groups`` (its EP and DP groups), ``worker`` (calibrate and
  serve in one launch); the package itself is the plugin glue (``vllm.general_plugins``
  entry point ``register``). docs/vllm.md.
- ``sglang/``: SGLang's Mega-MoE functions. ``sites`` (one entry per function), the package
  the plugin glue (``sglang.srt.plugins`` entry point ``register``). docs/sglang.md.
- ``transformers/``: the ``"moewire"`` experts implementation of transformers'
  ``ExpertsInterface``. docs/eval.md.
- ``modelopt/``: moewire's quantizers inside ``mtq.quantize``; ``quantizer`` (the
  ``TensorQuantizer`` subclass and the quant backend). docs/modelopt.md.

Beside them, what more than one host uses, written once:

- ``_host``: rebinding a host's global through the undo ledger, recognition of a host module
  by its source, ``{rank}`` paths, a calibration held across two RPCs, and
  ``register_host_classes`` (one host reaching another's experts classes through an entry
  point, never an import).
- ``deepgemm_sm90``: DeepGEMM's real SM90 Mega-MoE kernel as moewire's own experts module
  (used by the transformers host, the study and the evaluation).

No host package imports another (``tests/test_import_cycles.py`` reads the imports). A new
host is a package here: its table of site entries and its plugin glue. A new site of an
existing host is one entry in its ``sites`` table.

The flat module paths of moewire 0.1.0 (``vllm_worker``, ``vllm_sites``, ``_vllm_bridge``,
``_vllm_groups``, ``sglang_sites``, ``modelopt_quantizer``) are deprecated aliases of the new
ones until moewire 0.3.0 removes them (``moewire._moved``).

Nothing is imported here: each host imports its framework, which may be absent.
"""
