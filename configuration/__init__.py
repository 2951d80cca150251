"""archlab.configuration"""
