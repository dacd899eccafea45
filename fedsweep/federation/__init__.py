"""Federation: what happens to an update between a client's training and the method's aggregation.

Below the actors (which run these steps) and above the methods (which never see them): the update
(``update``), the client's and the server's chains (``chain``), codecs (``codecs``), robust rules
(``robust``), the compressed download (``download``), Byzantine clients (``attacks``), who answers a
round (``participation``), screening (``screening``) and what all of it refuses for a method
(``checks``). Pure policy and tensor code: no Ray, no engine.
"""
