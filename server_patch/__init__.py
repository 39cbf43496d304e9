"""SGLang integration: the extension endpoints (`/pd_role`, `/pd_drain`, `/convert_pd_role`).

`pd_protocol.extension` is framework-independent and imported by pd_worker too; the SGLang
adapter modules are imported only by `python -m server_patch.launch_server`, so importing this
package never imports SGLang, FastAPI or torch.
"""
