"""Model classes, one file per architecture family; ``registry.py`` maps HF names to them."""
