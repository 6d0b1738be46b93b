"""The one error type of the transfer layer: a copy or a signal that failed, timed out or was poisoned."""


class TransferError(RuntimeError):
    """A KV transfer failed; the message names the layer and counter where one is known."""
