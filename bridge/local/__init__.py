"""wsync's own processes and models on one machine: :mod:`~bridge.local.launch` starts a command's trainer ranks (a
static world on loopback, as torchrun would) and turns their failure into one line; :mod:`~bridge.local.presets`
builds models and tokenizers from configs, so nothing is ever downloaded."""
