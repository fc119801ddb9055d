package worker

import (
	"net/http"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/lazy"
	"github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/tenant"
)

// estimate says what a create on req.Layers, named as req.Tenant names
// them, would fetch here (api.Estimate): nothing for a layer the local
// store holds; for one only the remote holds, its size there less what
// this worker's lazy cache holds of it. An admin's route: what the
// store holds is no tenant's to learn.
func (w *worker) estimate(r *http.Request, req api.EstimateRequest) (api.Estimate, error) {
	ctx := r.Context()
	s := scope{w: w}
	if req.Tenant != "" {
		s.ns = tenant.Of(req.Tenant)
	}
	var e api.Estimate
	for _, l := range req.Layers {
		ref, err := s.layer(ctx, l)
		if err != nil {
			e.Missing++
			continue
		}
		if _, err := layer.ResolveImage(ctx, w.host.Store, ref, ""); err == nil {
			continue
		}
		pr, err := layer.ParseRef(ref)
		if err != nil || w.host.Remote == nil {
			e.Missing++
			continue
		}
		rl, err := remote.Describe(ctx, w.host.Remote, pr)
		if err != nil {
			e.Missing++
			continue
		}
		n := rl.Blob.Size
		if st, err := lazy.ReadStats(w.cfg.Root, rl.Blob.Digest); err == nil {
			n = max(n-st.BytesCached, 0)
		}
		e.FetchBytes += n
	}
	return e, nil
}
