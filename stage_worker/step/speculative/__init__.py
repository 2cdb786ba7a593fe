"""Speculative decoding's proposers on the last stage: a draft model (`draft`) and the checkpoint's
own multi-token-prediction layers (`mtp`)."""
