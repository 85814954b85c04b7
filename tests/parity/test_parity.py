"""The parity matrix. Items come from the kokoro-parity plugin: `pytest --backend=xnnpack -k decoder`."""


def test_parity(parity_item, check_parity):
    check_parity(parity_item)


def test_reference(golden_key, check_golden):
    """The fresh fp32 reference of a case equals the committed golden tensors."""
    check_golden(*golden_key)
