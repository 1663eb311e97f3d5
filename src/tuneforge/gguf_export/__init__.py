"""`tuneforge export --format gguf`: a trained checkpoint as one GGUF file for llama.cpp and Ollama, with the
chat template and stop tokens of training, and an Ollama Modelfile beside it."""
