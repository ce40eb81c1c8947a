"""vLLM model class for Qwen4Exp (imports vLLM; loaded lazily by the plugin)."""
