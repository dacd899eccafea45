#!/bin/bash
# What a client actor imports before it can build a model, on 2 cores, alone (2026-11-29, at b71c4fb):
# python's own import timer over torch, transformers' Llama modules and peft in a fresh interpreter,
# the second of two runs (the first warms the page cache); the cumulative times of the modules that
# cost most, packed into results.json beside this script.
.venv/bin/python -X importtime -c "import torch, transformers.models.llama.modeling_llama, peft" 2> /dev/null
.venv/bin/python -X importtime -c "import torch, transformers.models.llama.modeling_llama, peft" 2> imports.txt
