package kube

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/e2b"
)

// dsec's Kubernetes objects: slow configuration only, never an object
// per sandbox (deploy/kubernetes/base/crds.yaml).
const (
	Group   = "dsec.dev"
	Version = "v1alpha1"
	// finalizer holds an object until what it made in the fleet is gone.
	finalizer = Group + "/fleet"
	// resync is how often an object is applied again: a worker that
	// joined since has it too.
	resync = 30 * time.Second
	// LeaseName is the Lease (in the workers' Service's namespace) that
	// the gateway replica applying the objects holds.
	LeaseName = "dsec-gateway"
)

var (
	policyKind   = schema.GroupVersionKind{Group: Group, Version: Version, Kind: "SandboxPolicy"}
	templateKind = schema.GroupVersionKind{Group: Group, Version: Version, Kind: "SandboxTemplate"}
	poolKind     = schema.GroupVersionKind{Group: Group, Version: Version, Kind: "SandboxPool"}
)

// Objects applies the SandboxPolicy, SandboxTemplate and SandboxPool
// objects of the workers' Service's namespace to the fleet, through
// fleet (the gateway's Gateway.ActAs, as its admin), until ctx ends: a
// policy stored on every worker, a pool (of a template) sized across
// the fleet; each removed from the fleet with its object. Each object's
// status says whether it holds on every worker. templates, if any, is
// told every SandboxTemplate (its name: its spec) at each change, on
// every replica (the E2B front's template IDs).
func Objects(ctx context.Context, cfg Config, fleet http.Handler, log *slog.Logger, templates func(map[string]api.SandboxSpec)) error {
	rc, ns, _, err := connect(cfg)
	if err != nil {
		return err
	}
	lg := logr.FromSlogHandler(log.Handler())
	ctrllog.SetLogger(lg)
	// One replica of the gateway applies them at a time: the holder of
	// the Lease (its PUTs would only repeat one another's, and their
	// statuses conflict).
	mgr, err := ctrl.NewManager(rc, ctrl.Options{Logger: lg,
		Cache:   cache.Options{DefaultNamespaces: map[string]cache.Config{ns: {}}},
		Metrics: metricsserver.Options{BindAddress: "0"}, HealthProbeBindAddress: "0",
		LeaderElection: true, LeaderElectionID: LeaseName, LeaderElectionNamespace: ns,
		LeaderElectionResourceLock: "leases", LeaderElectionReleaseOnCancel: true})
	if err != nil {
		return err
	}
	a := &applier{c: mgr.GetClient(), fleet: fleet}
	if err := ctrl.NewControllerManagedBy(mgr).Named("sandboxpolicy").For(object(policyKind)).
		Complete(reconcile.Func(a.policy)); err != nil {
		return err
	}
	// A pool follows its template: a template changed is each of its
	// pools changed.
	poolsOf := handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
		list := &unstructured.UnstructuredList{}
		list.SetGroupVersionKind(poolKind.GroupVersion().WithKind("SandboxPoolList"))
		if err := a.c.List(ctx, list, client.InNamespace(o.GetNamespace())); err != nil {
			return nil
		}
		var out []reconcile.Request
		for _, p := range list.Items {
			if t, _, _ := unstructured.NestedString(p.Object, "spec", "template"); t == o.GetName() {
				out = append(out, reconcile.Request{NamespacedName: types.NamespacedName{Namespace: p.GetNamespace(), Name: p.GetName()}})
			}
		}
		return out
	})
	if err := ctrl.NewControllerManagedBy(mgr).Named("sandboxpool").For(object(poolKind)).
		Watches(object(templateKind), poolsOf).Complete(reconcile.Func(a.pool)); err != nil {
		return err
	}
	if templates != nil {
		every := false // (not the Lease holder's alone: each replica's front takes them)
		tl := &templateList{c: mgr.GetClient(), ns: ns, found: templates, log: log}
		if err := ctrl.NewControllerManagedBy(mgr).Named("sandboxtemplate").For(object(templateKind)).
			WithOptions(controller.Options{NeedLeaderElection: &every}).Complete(reconcile.Func(tl.list)); err != nil {
			return err
		}
	}
	return mgr.Start(ctx)
}

// templateList tells found every SandboxTemplate of ns.
type templateList struct {
	c     client.Client
	ns    string
	found func(map[string]api.SandboxSpec)
	log   *slog.Logger
}

// list tells tl.found every template as of now: one whose spec is no
// sandbox spec is left out, and logged.
func (tl *templateList) list(ctx context.Context, _ reconcile.Request) (reconcile.Result, error) {
	list := &unstructured.UnstructuredList{}
	list.SetGroupVersionKind(templateKind.GroupVersion().WithKind("SandboxTemplateList"))
	if err := tl.c.List(ctx, list, client.InNamespace(tl.ns)); err != nil {
		return reconcile.Result{}, err
	}
	out := map[string]api.SandboxSpec{}
	for _, t := range list.Items {
		if !t.GetDeletionTimestamp().IsZero() {
			continue
		}
		spec, err := templateSpec(&t)
		if err != nil {
			tl.log.Warn("a SandboxTemplate is no sandbox spec: left out", "template", t.GetName(), "err", err)
			continue
		}
		out[t.GetName()] = spec
	}
	tl.found(out)
	return reconcile.Result{}, nil
}

// templateSpec is t's spec as a sandbox's (a field this gateway does
// not know, a newer one's, left out).
func templateSpec(t *unstructured.Unstructured) (api.SandboxSpec, error) {
	spec, _, _ := unstructured.NestedMap(t.Object, "spec")
	b, err := json.Marshal(spec)
	if err != nil {
		return api.SandboxSpec{}, err
	}
	var s api.SandboxSpec
	return s, json.Unmarshal(b, &s)
}

func object(k schema.GroupVersionKind) *unstructured.Unstructured {
	u := &unstructured.Unstructured{}
	u.SetGroupVersionKind(k)
	return u
}

// applier applies objects to the fleet.
type applier struct {
	c     client.Client
	fleet http.Handler
}

// policy stores a SandboxPolicy on every worker, as `dsec policy save`
// through the gateway does (its spec is the policy document's body).
func (a *applier) policy(ctx context.Context, req reconcile.Request) (reconcile.Result, error) {
	return a.apply(ctx, req, policyKind, "/"+api.Version+"/policies/", func(u *unstructured.Unstructured) ([]byte, error) {
		doc, _, _ := unstructured.NestedMap(u.Object, "spec")
		if doc == nil {
			doc = map[string]any{}
		}
		doc["apiVersion"], doc["kind"] = "dsec/v1", "Policy"
		doc["metadata"] = map[string]any{"name": u.GetName()}
		return json.Marshal(doc)
	})
}

// pool sizes a SandboxPool across the fleet, as `dsec pool resize`
// through the gateway does, of its template's spec.
func (a *applier) pool(ctx context.Context, req reconcile.Request) (reconcile.Result, error) {
	return a.apply(ctx, req, poolKind, "/"+api.Version+"/pools/", func(u *unstructured.Unstructured) ([]byte, error) {
		size, _, _ := unstructured.NestedInt64(u.Object, "spec", "size")
		name, _, _ := unstructured.NestedString(u.Object, "spec", "template")
		t := object(templateKind)
		if err := a.c.Get(ctx, types.NamespacedName{Namespace: u.GetNamespace(), Name: name}, t); err != nil {
			return nil, fmt.Errorf("its template %s: %w", name, err)
		}
		s, err := templateSpec(t)
		if err != nil {
			return nil, fmt.Errorf("its template %s: %v", name, err)
		}
		return json.Marshal(api.PoolSpec{Size: int(size), Spec: &s})
	})
}

// apply PUTs what body makes of the object req names at path+name, or,
// once it is being deleted, DELETEs it there and lets it go; its status
// says how that went.
func (a *applier) apply(ctx context.Context, req reconcile.Request, k schema.GroupVersionKind, path string,
	body func(*unstructured.Unstructured) ([]byte, error)) (reconcile.Result, error) {
	u := object(k)
	if err := a.c.Get(ctx, req.NamespacedName, u); err != nil {
		return reconcile.Result{}, client.IgnoreNotFound(err)
	}
	at := path + url.PathEscape(u.GetName())
	if !u.GetDeletionTimestamp().IsZero() {
		if controllerutil.ContainsFinalizer(u, finalizer) {
			if status, msg := a.do(ctx, http.MethodDelete, at, nil); status/100 != 2 && status != http.StatusNotFound {
				return a.status(ctx, u, false, "not removed from the fleet: "+msg)
			}
			controllerutil.RemoveFinalizer(u, finalizer)
			return reconcile.Result{}, a.c.Update(ctx, u)
		}
		return reconcile.Result{}, nil
	}
	if controllerutil.AddFinalizer(u, finalizer) {
		if err := a.c.Update(ctx, u); err != nil {
			return reconcile.Result{}, err
		}
	}
	b, err := body(u)
	if err != nil {
		return a.status(ctx, u, false, err.Error())
	}
	status, msg := a.do(ctx, http.MethodPut, at, b)
	if status == http.StatusConflict && k == poolKind {
		// Its template changed: a worker keeps a pool's sandboxes of one
		// template, so the pool is made anew (its warm ones discarded).
		if status, msg = a.do(ctx, http.MethodDelete, at, nil); status/100 == 2 {
			status, msg = a.do(ctx, http.MethodPut, at, b)
		}
	}
	if status/100 != 2 {
		return a.status(ctx, u, false, msg)
	}
	return a.status(ctx, u, true, "applied to every worker up")
}

// status records whether u holds in the fleet, and why not; an object
// that does not is tried again sooner.
func (a *applier) status(ctx context.Context, u *unstructured.Unstructured, ok bool, msg string) (reconcile.Result, error) {
	old, _, _ := unstructured.NestedMap(u.Object, "status")
	st := map[string]any{"applied": ok, "message": msg, "observedGeneration": u.GetGeneration()}
	if old["applied"] != st["applied"] || old["message"] != st["message"] || old["observedGeneration"] != st["observedGeneration"] {
		unstructured.SetNestedMap(u.Object, st, "status")
		if err := a.c.Status().Update(ctx, u); err != nil && !errors.IsConflict(err) {
			return reconcile.Result{}, err
		}
	}
	if !ok {
		return reconcile.Result{RequeueAfter: 5 * time.Second}, nil
	}
	return reconcile.Result{RequeueAfter: resync}, nil
}

// do serves method path (body) on the fleet as its admin, and says its
// status and, for a failure, the message.
func (a *applier) do(ctx context.Context, method, path string, body []byte) (int, string) {
	r := httptest.NewRequestWithContext(ctx, method, path, bytes.NewReader(body))
	r.Header.Set(e2b.HeaderActAs, e2b.ActAsAdmin)
	r.Header.Set("Content-Type", "application/json")
	rw := httptest.NewRecorder()
	a.fleet.ServeHTTP(rw, r)
	msg := rw.Body.String()
	var e api.Error
	if json.Unmarshal(rw.Body.Bytes(), &e) == nil && e.Message != "" {
		msg = e.Message
	}
	return rw.Code, msg
}
