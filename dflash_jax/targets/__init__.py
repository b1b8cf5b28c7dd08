"""Target families behind the Target interface (`base`): dense Qwen3/Llama (`dense`, `dense_names`)."""
