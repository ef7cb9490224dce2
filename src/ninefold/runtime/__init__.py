"""ninefold.runtime"""
