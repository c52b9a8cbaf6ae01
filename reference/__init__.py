"""Single-device numerical references: Muon, SOAP, Shampoo, AdamW and a tiny Qwen3-style model
that the distributed runtime is verified against (DESIGN section 4). (To be built.)
"""
