"""netdsl.backends"""
