"""Megatron-LM `.bin`/`.idx` token corpora: the reader, and their import into packed MindRecord datasets."""
