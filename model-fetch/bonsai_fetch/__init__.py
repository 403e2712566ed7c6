"""bonsai-fetch: download and prepare Ternary-Bonsai-2-27B for vLLM (the init container's entry point).

The model directory it writes is complete and exactly what the options ask for: the prism_ternary checkpoint
(the published vLLM upload, or rebuilt from PrismML's official MLX pack), the vision tower put back under the
multimodal config vLLM 0.32 expects, the MTP head swapped for another one when asked, and the input
embedding exported for SSD lookup. See docs/model-fetch.md.
"""

__version__ = "0.1.0"
