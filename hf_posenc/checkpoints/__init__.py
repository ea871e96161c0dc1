"""Patched checkpoints: saving, loading, standalone export, the Hub and model cards.

- metadata.py: posenc_config.json (name, format version, read, write).
- saving.py: the patched model's save_pretrained and what it writes.
- restore.py: re-applying a saved patch to a freshly loaded model, checks first (also shipped in standalone code).
- loading.py: hf_posenc.from_pretrained.
- export.py: standalone checkpoints (the library's own modules copied flat, loaded with trust_remote_code=True).
- hub.py: push_to_hub, and the library's part of save_pretrained(standalone=True, push_to_hub=True).
- model_card.py: make_model_card.
- adapters.py: PEFT adapters of a patched model (save_adapter, load_adapter).
"""
