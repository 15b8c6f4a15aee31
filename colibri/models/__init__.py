"""One thin module per Hugging Face model_type."""
