"""pd-router: a router for SGLang prefill/decode disaggregation with in-process role conversion."""

__version__ = "0.1.0"
