// Package kube finds a gateway's workers in Kubernetes: the endpoints
// of the workers' Service (their DaemonSet's pods), as its
// EndpointSlices list them, followed with a watch.
package kube

import (
	"cmp"
	"context"
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/containerd/errdefs"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	discoveryclient "k8s.io/client-go/kubernetes/typed/discovery/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/dsec-project/dsec/internal/gateway"
)

// Config says where the workers are and how to reach them.
type Config struct {
	// Service is the workers' Service, NAMESPACE/NAME, or NAME in the
	// gateway's own namespace (its pod's).
	Service string
	// Port names the Service's port of the workers' API (default "api";
	// a Service of one port: that one).
	Port string
	// Kubeconfig is a kubeconfig file; "": the pod's service account.
	Kubeconfig string
	// Worker is how each is reached: its admin token, the CA its
	// certificate is checked against, the name that certificate bears
	// (all the DaemonSet's pods share one), the gateway's client
	// certificate. Its URL is the endpoint's.
	Worker gateway.Worker
}

// namespaceFile is where a pod's service account says its namespace.
const namespaceFile = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

// Discover is cfg's gateway.Config.Discover: it calls found with the
// workers every EndpointSlice of the Service names, ready or not (a
// worker whose node stopped answering stays in the fleet, down, its
// sandboxes reported unreachable), at each change, until ctx ends.
func Discover(cfg Config) (func(ctx context.Context, found func([]gateway.Worker)) error, error) {
	rc, ns, name, err := connect(cfg)
	if err != nil {
		return nil, err
	}
	client, err := discoveryclient.NewForConfig(rc)
	if err != nil {
		return nil, err
	}
	api := client.EndpointSlices(ns)
	selector := discoveryv1.LabelServiceName + "=" + name
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.LabelSelector = selector
			return api.List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.LabelSelector = selector
			return api.Watch(ctx, o)
		},
	}
	port := cmp.Or(cfg.Port, "api")
	return func(ctx context.Context, found func([]gateway.Worker)) error {
		inf := cache.NewSharedIndexInformer(lw, &discoveryv1.EndpointSlice{}, 0, cache.Indexers{})
		changed := make(chan struct{}, 1)
		poke := func(any) {
			select {
			case changed <- struct{}{}:
			default:
			}
		}
		if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: poke,
			UpdateFunc: func(_, o any) { poke(o) }, DeleteFunc: poke}); err != nil {
			return err
		}
		go inf.RunWithContext(ctx)
		var last []string
		for {
			select {
			case <-ctx.Done():
				return nil
			case <-changed:
			}
			var urls []string
			for _, o := range inf.GetStore().List() {
				urls = append(urls, Workers(o.(*discoveryv1.EndpointSlice), port)...)
			}
			slices.Sort(urls)
			urls = slices.Compact(urls)
			if slices.Equal(urls, last) {
				continue
			}
			last = urls
			ws := make([]gateway.Worker, len(urls))
			for i, u := range urls {
				ws[i] = cfg.Worker
				ws[i].URL = u
			}
			found(ws)
		}
	}, nil
}

// connect is the API server's configuration cfg says, and the workers'
// Service's namespace and name.
func connect(cfg Config) (rc *rest.Config, ns, name string, err error) {
	ns, name, ok := strings.Cut(cfg.Service, "/")
	if !ok {
		name = ns
		b, err := os.ReadFile(namespaceFile)
		if err != nil {
			return nil, "", "", fmt.Errorf("the workers' Service %q names no namespace, and the gateway runs in no pod (%v): give NAMESPACE/NAME: %w", cfg.Service, err, errdefs.ErrInvalidArgument)
		}
		ns = strings.TrimSpace(string(b))
	}
	if ns == "" || name == "" || strings.Contains(name, "/") {
		return nil, "", "", fmt.Errorf("bad workers' Service %q: give NAMESPACE/NAME: %w", cfg.Service, errdefs.ErrInvalidArgument)
	}
	if cfg.Kubeconfig != "" {
		rc, err = clientcmd.BuildConfigFromFlags("", cfg.Kubeconfig)
	} else {
		rc, err = rest.InClusterConfig()
	}
	if err != nil {
		return nil, "", "", fmt.Errorf("the Kubernetes API: %v (in a pod, its service account; else give a kubeconfig): %w", err, errdefs.ErrInvalidArgument)
	}
	rc.UserAgent = "dsec-gateway"
	return rc, ns, name, nil
}

// Workers are the URLs (tcp://ADDRESS:PORT) of the endpoints s lists
// on its port named port (or its only port), ready or not, but none
// terminating.
func Workers(s *discoveryv1.EndpointSlice, port string) []string {
	var num int32
	for _, p := range s.Ports {
		if p.Port != nil && (p.Name != nil && *p.Name == port || len(s.Ports) == 1) {
			num = *p.Port
		}
	}
	if num <= 0 || s.AddressType == discoveryv1.AddressTypeFQDN {
		return nil
	}
	var out []string
	for _, e := range s.Endpoints {
		if e.Conditions.Terminating != nil && *e.Conditions.Terminating {
			continue
		}
		for _, a := range e.Addresses {
			if net.ParseIP(a) != nil {
				out = append(out, "tcp://"+net.JoinHostPort(a, strconv.Itoa(int(num))))
			}
		}
	}
	return out
}
