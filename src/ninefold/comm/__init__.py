"""ninefold.comm"""
