"""Platform adapters: each turns chat events into `InboundMessage`s and sends replies back."""
