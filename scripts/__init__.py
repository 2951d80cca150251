"""archlab.scripts"""
