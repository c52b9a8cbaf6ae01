"""The torch.distributed runtime that executes a `Plan` (DESIGN section 9). (To be built.)"""
