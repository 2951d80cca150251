"""archlab.tokenization"""
