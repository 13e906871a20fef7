"""Naming and storage of models: one name resolver, the Ollama store, the registry client, pull,
the pair catalogue and the tiny generated models. Nothing here loads a model."""
