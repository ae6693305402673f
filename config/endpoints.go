package config

import (
	"fmt"
	"net/netip"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// EndpointsToSlices converts a hand-written v1 Endpoints object into
// EndpointSlices (one per subset and IP family), the way the EndpointSlice
// mirroring controller would: addresses are ready, notReadyAddresses are neither
// ready nor serving.
func EndpointsToSlices(eps *v1.Endpoints) ([]*discovery.EndpointSlice, error) {
	if eps.Name == "" {
		return nil, fmt.Errorf("metadata.name: required (it names the Service)")
	}
	var out []*discovery.EndpointSlice
	for si, ss := range eps.Subsets {
		var ports []discovery.EndpointPort
		for pi, p := range ss.Ports {
			if p.Port < 1 || p.Port > 65535 {
				return nil, fmt.Errorf("subsets[%d].ports[%d].port: %d is outside 1..65535", si, pi, p.Port)
			}
			ports = append(ports, discovery.EndpointPort{
				Name: ptr(p.Name), Port: ptr(p.Port), Protocol: ptr(p.Protocol),
			})
		}
		byFamily := map[discovery.AddressType]*discovery.EndpointSlice{}
		add := func(field string, i int, a v1.EndpointAddress, ready bool) error {
			ip, err := netip.ParseAddr(a.IP)
			if err != nil {
				return fmt.Errorf("subsets[%d].%s[%d].ip: %q is not an IP address", si, field, i, a.IP)
			}
			at := discovery.AddressTypeIPv4
			if Family(ip) == 6 {
				at = discovery.AddressTypeIPv6
			}
			es := byFamily[at]
			if es == nil {
				es = &discovery.EndpointSlice{
					ObjectMeta: metav1.ObjectMeta{
						Namespace: eps.Namespace,
						Name:      fmt.Sprintf("%s-endpoints-%d-%s", eps.Name, si, at),
						Labels:    map[string]string{LabelServiceName: eps.Name},
					},
					AddressType: at,
					Ports:       ports,
				}
				byFamily[at] = es
				out = append(out, es)
			}
			es.Endpoints = append(es.Endpoints, discovery.Endpoint{
				Addresses:  []string{a.IP},
				Conditions: discovery.EndpointConditions{Ready: ptr(ready), Serving: ptr(ready), Terminating: ptr(false)},
				NodeName:   a.NodeName,
			})
			return nil
		}
		for i, a := range ss.Addresses {
			if err := add("addresses", i, a, true); err != nil {
				return nil, err
			}
		}
		for i, a := range ss.NotReadyAddresses {
			if err := add("notReadyAddresses", i, a, false); err != nil {
				return nil, err
			}
		}
	}
	return out, nil
}

func ptr[T any](v T) *T { return &v }
