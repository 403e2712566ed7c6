"""Retraining the MTP head (`mtp.*`) on the served model's own output: the vLLM-free core.

- `head`: the Qwen3.5 MTP drafter's forward in plain torch (vLLM's `Qwen3_5MultiTokenPredictor` maths);
- `train`: dataset of (last hidden state, token ids), next-next-token loss, resumable training;
- `io`: reading the model's frozen parts and writing `mtp.safetensors` in the checkpoint's own layout.
"""
