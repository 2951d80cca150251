"""archlab.model_cards"""
